"""Only here for the build steps; all metadata is in pyproject.toml.

build_py generates the gRPC stubs (serving/codegen.py) and, where RECSHIP_BUILD_CPP asks, builds the C++ parts
(cpp_loader/build.py: cmake into the cached build/cpp_loader, or RECSHIP_CPP_BUILD_DIR) and installs them into
the package as recship/_cpp (bin/, lib/, include/, lib/cmake/recship/), where recship.native finds them:

    RECSHIP_BUILD_CPP=1      librecship_loader and recship_predict, and recship_front where gRPC C++ is found
    RECSHIP_BUILD_CPP=front  the same, and the build fails where recship_front cannot be built (the Docker image)
    unset or 0               no C++ (a pure wheel; a source checkout builds cpp_loader/ on first use)

It needs torch, fbgemm_gpu and nlohmann-json importable (``pip wheel --no-build-isolation``), cmake >= 3.19 and a
C++17 compiler. An editable install never builds it: there recship.native builds cpp_loader/ when first asked.
"""

import importlib.util
import os
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
CPP_CHOICES = {"": None, "0": None, "1": "optional", "front": "required"}


def _cpp_mode() -> "str | None":
    """RECSHIP_BUILD_CPP as None (no C++), "optional" (recship_front where gRPC C++ is found) or "required"."""
    value = os.environ.get("RECSHIP_BUILD_CPP", "").strip()
    if value not in CPP_CHOICES:
        raise ValueError(f"RECSHIP_BUILD_CPP={value!r}: one of 0, 1, front")
    return CPP_CHOICES[value]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """Runs serving/codegen.py (protos/ -> serving/v1/*_pb2*.py) before the modules are collected, then the C++ step."""

    def run(self):
        _load("recship_codegen", HERE / "serving" / "codegen.py").generate()
        super().run()
        mode = _cpp_mode()
        if mode is not None and not getattr(self, "editable_mode", False):
            build_dir = os.environ.get("RECSHIP_CPP_BUILD_DIR")
            dest = Path(self.build_lib) / "recship" / "_cpp"
            print(f"building the C++ parts (cpp_loader/, cmake; recship_front {mode}) into {dest}", flush=True)
            try:
                _load("recship_cpp_build", HERE / "cpp_loader" / "build.py").package(
                    dest, build_dir=Path(build_dir) if build_dir else None, require_front=mode == "required")
            except subprocess.CalledProcessError as e:  # cmake's own words, not only its exit status
                raise RuntimeError(f"RECSHIP_BUILD_CPP: {' '.join(e.cmd)} failed:\n{(e.stderr or e.stdout or '')[-4000:]}") from None


class MaybeBinaryDistribution(Distribution):
    """A platform wheel (linux_x86_64, ...) where it carries the C++ binaries, a pure one otherwise."""

    def has_ext_modules(self):
        return _cpp_mode() is not None or super().has_ext_modules()


setup(cmdclass={"build_py": BuildPyWithProtos}, distclass=MaybeBinaryDistribution)
