"""Only here for the build steps; all metadata is in pyproject.toml.

build_py generates the gRPC stubs (serving/codegen.py) and, unless RECSHIP_BUILD_CPP=0, builds the C++ parts
(cpp_loader/build.py's relocatable build, cmake into build/cpp_wheel or RECSHIP_CPP_BUILD_DIR, its progress shown)
and installs them into the package as recship/_cpp (bin/, lib/, include/, lib/cmake/recship/), where
recship.native finds them:

    unset or 1               librecship_loader and recship_predict, and recship_front and recship_load where gRPC
                             C++ is found
    RECSHIP_BUILD_CPP=front  the same, and the build fails where recship_front cannot be built (the Docker image)
    RECSHIP_BUILD_CPP=0      no C++ (a pure wheel; a source checkout builds cpp_loader/ on first use)

The C++ build compiles against torch and nlohmann-json (the build backend, cpp_loader/backend/build_backend.py, installs
them into an isolated build environment; ``pip wheel --no-build-isolation`` takes the environment's) and needs
cmake >= 3.19 and a C++17 compiler. An editable install never builds it: there recship.native builds cpp_loader/
when first asked. The wheel is tagged linux_x86_64; ``make wheel`` repairs it to a manylinux tag (auditwheel).
"""

import importlib.util
import os
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
CPP_CHOICES = {"": "optional", "1": "optional", "front": "required", "0": None}


def _cpp_mode() -> "str | None":
    """RECSHIP_BUILD_CPP as None (no C++), "optional" (recship_front where gRPC C++ is found; the default) or
    "required"."""
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
            except subprocess.CalledProcessError as e:  # cmake's words are above (its output streams)
                raise RuntimeError(f"building the C++ parts failed ({' '.join(map(str, e.cmd))}: exit {e.returncode}; "
                                   f"cmake's output is above). RECSHIP_BUILD_CPP=0 builds a wheel without them") from None
            except FileNotFoundError as e:
                raise RuntimeError(f"building the C++ parts needs cmake >= 3.19 and a C++17 compiler ({e}); "
                                   f"RECSHIP_BUILD_CPP=0 builds a wheel without them") from None
            tools = sorted(p.name for p in (dest / "bin").iterdir())
            print(f"recship/_cpp: {', '.join(tools)}" + ("" if "recship_front" in tools else
                  " (no recship_front: gRPC C++ was not found; RECSHIP_BUILD_CPP=front makes that an error)"), flush=True)


class MaybeBinaryDistribution(Distribution):
    """A platform wheel (linux_x86_64, ...) where it carries the C++ binaries, a pure one otherwise."""

    def has_ext_modules(self):
        return _cpp_mode() is not None or super().has_ext_modules()


setup(cmdclass={"build_py": BuildPyWithProtos}, distclass=MaybeBinaryDistribution)
