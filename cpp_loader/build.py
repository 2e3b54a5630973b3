"""Builds the C++ loader (Release, -j2) into build/cpp_loader; cmake's own cache makes rebuilds incremental.

    python cpp_loader/build.py        # prints the build directory
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / "build" / "cpp_loader"


def build(build_dir: Path = BUILD, jobs: int = 2) -> Path:
    import fbgemm_gpu
    import nlohmann_json
    import torch

    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / "CMakeCache.txt").exists():
        subprocess.run(
            [
                "cmake", "-S", str(HERE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                f"-DNLOHMANN_JSON_INCLUDE_DIR={nlohmann_json.get_include()}",
                f"-DRECSHIP_FBGEMM_DIR={os.path.dirname(fbgemm_gpu.__file__)}",
                f"-DPython_EXECUTABLE={sys.executable}",
            ],
            check=True, capture_output=True, text=True,
        )
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs)], check=True, capture_output=True, text=True)
    return build_dir


if __name__ == "__main__":
    print(build())
