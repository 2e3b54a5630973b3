"""The C++ parts (``recship_predict``, ``recship_front``, ``recship_load``, ``librecship_loader`` and its headers) where
recship has them.

A wheel built with its C++ parts (setup.py's build step, unless ``RECSHIP_BUILD_CPP=0``) carries them as
``recship/_cpp/``: ``bin/`` (recship_predict; recship_front and recship_load where gRPC C++ was found), ``lib/``
(librecship_loader.so), ``lib/cmake/recship/`` (``find_package(recship)``: target ``recship::loader``) and
``include/recship/``. Those are used first. Without them (an editable install, a wheel built with
``RECSHIP_BUILD_CPP=0``) a source checkout builds ``cpp_loader/`` into ``build/cpp_loader`` on first use (cmake,
incremental); elsewhere ``find`` raises ``NativeError`` saying how to get them.

    recship_predict ARTIFACT_DIR [...]            # the console script: runs the binary find("recship_predict") gives
    python -m recship.native cmake-prefix         # CMAKE_PREFIX_PATH for find_package(recship CONFIG REQUIRED)
    python -m recship.native path recship_front   # where a tool is (building it in a source checkout)

The binaries run with ``runtime_env()``: torch's ``lib/`` folder first on ``LD_LIBRARY_PATH`` and
``RECSHIP_FBGEMM_DIR`` set to fbgemm_gpu's folder, both as this Python would import them (found without importing
either), so an installed wheel runs against the environment's torch and fbgemm_gpu wherever they live.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional

PACKAGED = Path(__file__).resolve().parent / "_cpp"
# a source checkout: recship/ beside cpp_loader/ (an installed package has no cpp_loader/ beside it)
SOURCE_BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "cpp_loader" / "build.py"
TOOLS = ("recship_predict", "recship_front", "recship_load")  # recship_load: bench/serve_bench.py's load generator
GRPC_DEBIAN = "libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler"


class NativeError(RuntimeError):
    """A C++ tool is neither installed with recship nor can it be built here (the message says why and what to do)."""


def packaged(name: str) -> Optional[Path]:
    """Path of tool ``name`` in the installed package (recship/_cpp/bin), None where it is not there."""
    _check_name(name)
    path = PACKAGED / "bin" / name
    return path if path.is_file() else None


def source_checkout() -> bool:
    """Whether recship runs from a source checkout (cpp_loader/build.py beside the recship/ folder)."""
    return SOURCE_BUILD_SCRIPT.is_file()


def find(name: str) -> Path:
    """Path of tool ``name`` (one of TOOLS): the packaged one, else built from the source
    checkout (incremental: minutes the first time, seconds after). NativeError where neither can be had."""
    found = packaged(name)
    if found is not None:
        return found
    if PACKAGED.is_dir():  # C++ was packaged, this tool was not: its build lacked gRPC C++
        raise NativeError(f"{name} is not in this installation ({PACKAGED / 'bin'}): its wheel was built without gRPC C++ "
                          f"(Debian: {GRPC_DEBIAN}); rebuild the wheel with them installed and RECSHIP_BUILD_CPP=front")
    if not source_checkout():
        raise NativeError(f"{name} is not installed with recship (its wheel was built with RECSHIP_BUILD_CPP=0) and "
                          f"there is no source checkout to build it from: install a wheel built with its C++ parts "
                          f"(`make wheel`; RECSHIP_BUILD_CPP=front to require recship_front), or the recship Docker image")
    build_dir = _build_from_source()
    binary = build_dir / name
    if not binary.is_file():
        raise NativeError(f"{name} was not built: gRPC C++ is missing (Debian: {GRPC_DEBIAN}; `make install` installs them)")
    return binary


def _build_from_source() -> Path:
    """cpp_loader/build.py's ``build()`` (the cached build/cpp_loader); NativeError with cmake's words on failure."""
    spec = importlib.util.spec_from_file_location("recship_cpp_build", SOURCE_BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.build()
    except subprocess.CalledProcessError as e:
        raise NativeError(f"building cpp_loader/ failed: {(e.stderr or e.stdout or '').strip()[-2000:]}") from None
    except FileNotFoundError as e:  # no cmake
        raise NativeError(f"building cpp_loader/ needs cmake >= 3.18 and a C++17 compiler: {e}") from None


def cmake_prefix() -> Path:
    """The folder for CMAKE_PREFIX_PATH (``find_package(recship CONFIG REQUIRED)``); NativeError where not packaged."""
    if not (PACKAGED / "lib" / "cmake" / "recship" / "recshipConfig.cmake").is_file():
        raise NativeError("the C++ library is not installed with recship (its wheel was built with RECSHIP_BUILD_CPP=0); "
                          "in a source checkout link cpp_loader/ with add_subdirectory (README, C++)")
    return PACKAGED


def _package_dir(name: str) -> Optional[Path]:
    """The folder of top-level package ``name`` as this Python would import it, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def runtime_env(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``base`` (default os.environ) with torch's lib/ first on LD_LIBRARY_PATH and RECSHIP_FBGEMM_DIR set to
    fbgemm_gpu's folder (kept where ``base`` sets it), for running a packaged or source-built tool."""
    env = dict(os.environ if base is None else base)
    torch_dir = _package_dir("torch")
    if torch_dir is not None and (torch_dir / "lib").is_dir():
        paths = [str(torch_dir / "lib")] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(paths))
    fbgemm_dir = _package_dir("fbgemm_gpu")
    if fbgemm_dir is not None and not env.get("RECSHIP_FBGEMM_DIR"):
        env["RECSHIP_FBGEMM_DIR"] = str(fbgemm_dir)
    return env


def predict_main(argv: Optional[List[str]] = None) -> None:
    """The ``recship_predict`` console script: replaces this process with the C++ tool (same arguments, exit codes)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        binary = find("recship_predict")
    except NativeError as e:
        print(f"recship_predict: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(str(binary), [str(binary), *args], runtime_env())


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m recship.native cmake-prefix | path TOOL``: prints the folder or the tool's path."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if args == ["cmake-prefix"]:
            print(cmake_prefix())
            return 0
        if len(args) == 2 and args[0] == "path":
            print(find(args[1]))
            return 0
    except (NativeError, ValueError) as e:
        print(f"recship.native: {e}", file=sys.stderr)
        return 1
    print(f"usage: python -m recship.native cmake-prefix | path {{{','.join(TOOLS)}}}", file=sys.stderr)
    return 2


def _check_name(name: str) -> None:
    if name not in TOOLS:
        raise ValueError(f"unknown C++ tool {name!r}: one of {', '.join(TOOLS)}")


if __name__ == "__main__":
    sys.exit(main())
