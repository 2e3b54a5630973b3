"""Builds the C++ loader (Release, -j2) into build/cpp_loader; cmake's own cache makes rebuilds incremental.

    python cpp_loader/build.py             # prints the build directory
    python cpp_loader/build.py --sanitize  # the AddressSanitizer + UBSan build (warnings as errors), build/cpp_loader_sanitize

The sanitized build (RECSHIP_SANITIZE, CMakeLists.txt) is for tests/cpp_loader/test_cpp_sanitized.py: only
recship_predict and recship_front, in a folder of its own, cached like the normal one.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / "build" / "cpp_loader"
SANITIZE_BUILD = HERE.parent / "build" / "cpp_loader_sanitize"


def build(build_dir: Optional[Path] = None, jobs: int = 2, sanitize: bool = False) -> Path:
    """Configures (once) and builds; returns the build folder. CalledProcessError (with cmake's output) on failure.

    ``sanitize``: -fsanitize=address,undefined and -Werror, targets recship_predict and recship_front only
    (default folder build/cpp_loader_sanitize); cmake fails naming RECSHIP_SANITIZE where the compiler
    cannot link the sanitizers.
    """
    import fbgemm_gpu
    import nlohmann_json
    import torch

    build_dir = build_dir or (SANITIZE_BUILD if sanitize else BUILD)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / "CMakeCache.txt").exists():
        options = ["-DRECSHIP_SANITIZE=ON", "-DRECSHIP_WERROR=ON"] if sanitize else []
        try:
            subprocess.run(
                [
                    "cmake", "-S", str(HERE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                    f"-DNLOHMANN_JSON_INCLUDE_DIR={nlohmann_json.get_include()}",
                    f"-DRECSHIP_FBGEMM_DIR={os.path.dirname(fbgemm_gpu.__file__)}",
                    f"-DPython_EXECUTABLE={sys.executable}", *options,
                ],
                check=True, capture_output=True, text=True,
            )
        except subprocess.CalledProcessError:  # a cache without a build system: the next call must configure again
            (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
            raise
    targets: Sequence[str] = ["--target", "recship_predict", "recship_front"] if sanitize else []
    if sanitize and not _has_target(build_dir, "recship_front"):  # no gRPC C++ here: the loader and recship_predict
        targets = ["--target", "recship_predict"]
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), *targets], check=True, capture_output=True, text=True)
    return build_dir


def _has_target(build_dir: Path, target: str) -> bool:
    """Whether the configured build folder defines ``target`` (recship_front needs gRPC C++)."""
    return (build_dir / "CMakeFiles" / f"{target}.dir").is_dir()


if __name__ == "__main__":
    print(build(sanitize="--sanitize" in sys.argv[1:]))
