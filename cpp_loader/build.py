"""Builds the C++ loader (Release, -j2) into build/cpp_loader; cmake's own cache makes rebuilds incremental.

    python cpp_loader/build.py             # prints the build directory
    python cpp_loader/build.py --sanitize  # the AddressSanitizer + UBSan build (warnings as errors), build/cpp_loader_sanitize

The sanitized build (RECSHIP_SANITIZE, CMakeLists.txt) is for tests/cpp_loader/test_cpp_sanitized.py: only
recship_predict and recship_front, in a folder of its own, cached like the normal one.

``package(dest)`` builds the relocatable variant (RECSHIP_RELOCATABLE: nothing in it names a folder of this machine)
into build/cpp_wheel, printing cmake's progress, and installs it into ``dest`` (``cmake --install``: bin/, lib/,
include/, lib/cmake/recship): setup.py's build step packages them as the wheel's recship/_cpp.
"""

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / "build" / "cpp_loader"
SANITIZE_BUILD = HERE.parent / "build" / "cpp_loader_sanitize"
WHEEL_BUILD = HERE.parent / "build" / "cpp_wheel"


def build(build_dir: Optional[Path] = None, jobs: int = 2, sanitize: bool = False, relocatable: bool = False,
          verbose: bool = False) -> Path:
    """Configures (once) and builds; returns the build folder. CalledProcessError (with cmake's output) on failure.

    ``sanitize``: -fsanitize=address,undefined and -Werror, targets recship_predict and recship_front only
    (default folder build/cpp_loader_sanitize); cmake fails naming RECSHIP_SANITIZE where the compiler
    cannot link the sanitizers. ``relocatable``: the wheel's variant (RECSHIP_RELOCATABLE, default folder
    build/cpp_wheel): needs no fbgemm_gpu. ``verbose``: cmake's output goes to this process's stdout as it comes
    (a wheel build's progress) instead of being kept for the error.
    """
    build_dir = build_dir or (SANITIZE_BUILD if sanitize else WHEEL_BUILD if relocatable else BUILD)
    build_dir.mkdir(parents=True, exist_ok=True)
    # one build at a time per folder: concurrent test processes (and several checkouts' tools) share it
    with open(build_dir.parent / f".{build_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(build_dir, jobs, sanitize, relocatable, verbose)


# what a build is made from, besides cpp_loader/: the serving rules and the manifest schema it generates headers from
INPUTS = [HERE, HERE.parent / "protos", HERE.parent / "recship" / "contract" / "manifest.schema.json"]
STAMP = ".recship-sources"  # in a build folder: the fingerprint of the sources its last successful build was of


def _fingerprint(sanitize: bool, relocatable: bool) -> str:
    """Every input file's path, size and mtime, the torch and fbgemm_gpu it builds against and this Python: equal
    fingerprints, the same build (what cmake's own no-op check finds, in milliseconds instead of seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    lines = [f"sanitize {sanitize}", f"relocatable {relocatable}", f"python {sys.executable}"]
    for dist in ("torch", "fbgemm_gpu", "fbgemm_gpu_cpu", "nlohmann-json"):
        try:
            lines.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            lines.append(f"{dist} -")
    for root in INPUTS:
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts:
                st = f.stat()
                lines.append(f"{f.relative_to(HERE.parent)} {st.st_size} {st.st_mtime_ns}")
    return "\n".join(lines) + "\n"


def _build_locked(build_dir: Path, jobs: int, sanitize: bool, relocatable: bool, verbose: bool) -> Path:
    fingerprint = _fingerprint(sanitize, relocatable)
    stamp = build_dir / STAMP
    if (build_dir / "recship_predict").is_file() and stamp.is_file() and stamp.read_text() == fingerprint:
        return build_dir  # nothing changed since the last build (each test process and server asks once)
    stamp.unlink(missing_ok=True)
    import nlohmann_json

    if not (build_dir / "CMakeCache.txt").exists():
        options = ["-DRECSHIP_SANITIZE=ON", "-DRECSHIP_WERROR=ON"] if sanitize else []
        if relocatable:  # the wheel: finds the fbgemm_gpu installed beside it, at run time
            options.append("-DRECSHIP_RELOCATABLE=ON")
        else:
            import fbgemm_gpu

            options.append(f"-DRECSHIP_FBGEMM_DIR={os.path.dirname(fbgemm_gpu.__file__)}")
        try:
            _cmake(["-S", str(HERE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_PREFIX_PATH={_torch_cmake_prefix()}",
                    f"-DNLOHMANN_JSON_INCLUDE_DIR={nlohmann_json.get_include()}", *options], verbose)
        except subprocess.CalledProcessError:  # a cache without a build system: the next call must configure again
            (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
            raise
    targets: Sequence[str] = ["--target", "recship_predict", "recship_front"] if sanitize else []
    if sanitize and not _has_target(build_dir, "recship_front"):  # no gRPC C++ here: the loader and recship_predict
        targets = ["--target", "recship_predict"]
    _cmake(["--build", str(build_dir), "-j", str(jobs), *targets], verbose)
    stamp.write_text(fingerprint)
    return build_dir


def _torch_cmake_prefix() -> str:
    """torch.utils.cmake_prefix_path (torch/share/cmake), found without importing torch (seconds, and numpy's warning
    in a build environment that has no numpy)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the C++ build needs torch installed (its headers, libraries and CMake config)")
    return os.path.join(list(spec.submodule_search_locations)[0], "share", "cmake")


def _cmake(args: Sequence[str], verbose: bool) -> None:
    """Runs cmake; ``verbose``: its output streams to stdout (CalledProcessError then carries none)."""
    if verbose:
        print("cmake", *args, flush=True)
        subprocess.run(["cmake", *args], check=True, stderr=subprocess.STDOUT)
    else:
        subprocess.run(["cmake", *args], check=True, capture_output=True, text=True)


def package(dest: Path, build_dir: Optional[Path] = None, jobs: int = 2, require_front: bool = False) -> Path:
    """Builds the relocatable variant (``build``: the cached folder, build/cpp_wheel by default), showing cmake's
    progress, and installs it into ``dest``; returns ``dest``.

    ``dest`` receives bin/recship_predict (and bin/recship_front and bin/recship_load where gRPC C++ is found),
    lib/librecship_loader.so, lib/cmake/recship/ (find_package(recship)) and include/recship/. ``require_front``:
    RuntimeError where recship_front was not built (gRPC C++ missing) instead of packaging without it.
    """
    build_dir = build(build_dir, jobs=jobs, relocatable=True, verbose=True)
    if require_front and not _has_target(build_dir, "recship_front"):
        raise RuntimeError("recship_front was not built: gRPC C++ is missing (Debian: libgrpc++-dev protobuf-compiler-grpc "
                           "libprotobuf-dev protobuf-compiler pkg-config)")
    dest = Path(dest)
    for sub in ("bin", "lib", "include"):  # an earlier install's files must not outlive this one's
        shutil.rmtree(dest / sub, ignore_errors=True)
    _cmake(["--install", str(build_dir), "--prefix", str(dest)], verbose=True)
    return dest


def _has_target(build_dir: Path, target: str) -> bool:
    """Whether the configured build folder defines ``target`` (recship_front needs gRPC C++)."""
    return (build_dir / "CMakeFiles" / f"{target}.dir").is_dir()


if __name__ == "__main__":
    print(build(sanitize="--sanitize" in sys.argv[1:]))
