"""recship's PEP 517 build backend: setuptools' own, plus what a wheel's C++ parts need to build.

pyproject.toml names it (``backend-path = ["cpp_loader/backend"]``: a folder of its own, so that no module of
cpp_loader/ shadows a package setuptools imports). A wheel built with the C++ parts (the default; see
setup.py's RECSHIP_BUILD_CPP) compiles against torch's headers and libraries and nlohmann-json's headers, so with
build isolation (``pip wheel .``, ``python -m build``) those are installed into the build environment too, at
the pins pyproject.toml gives them, and cmake where the machine has none of at least 3.19. An sdist, an editable
install and a pure-Python wheel (RECSHIP_BUILD_CPP=0) need only setuptools and grpcio-tools. gRPC C++ (for
recship_front) and the C++ compiler come from the system: no Python package provides them.
"""

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import List, Optional

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # the hooks recship leaves to setuptools
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = ["build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable", "get_requires_for_build_sdist",
           "get_requires_for_build_wheel", "prepare_metadata_for_build_editable", "prepare_metadata_for_build_wheel"]

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
CMAKE_MINIMUM = (3, 19)  # cpp_loader/CMakeLists.txt's cmake_minimum_required
CMAKE_PIN = "cmake==4.4.5"  # installed into the build environment only where the machine's cmake is missing or older


def cpp_requirements(pyproject: Path = PYPROJECT, cmake_version: Optional[tuple] = None) -> List[str]:
    """What building the C++ parts adds to setuptools' requirements: torch and nlohmann-json as pyproject.toml pins
    them (torch in the dependencies, nlohmann-json in the dev extra), and cmake where ``cmake_version`` (default:
    the machine's) is None or older than 3.19."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = {"torch": project["dependencies"], "nlohmann-json": project["optional-dependencies"]["dev"]}
    pins = []
    for name, requirements in wanted.items():
        found = [r for r in requirements if re.match(rf"{re.escape(name)}\s*[=<>!~]", r)]
        if len(found) != 1:
            raise RuntimeError(f"{pyproject}: expected one pinned {name} requirement, found {found}")
        pins.append(found[0])
    version = _machine_cmake() if cmake_version is None else cmake_version
    if version is None or version < CMAKE_MINIMUM:
        pins.append(CMAKE_PIN)
    return pins


def _machine_cmake() -> Optional[tuple]:
    """The (major, minor) of the cmake on PATH, None where there is none."""
    cmake = shutil.which("cmake")
    if cmake is None:
        return None
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"(\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _builds_cpp() -> bool:
    """setup.py's reading of RECSHIP_BUILD_CPP: anything but 0 builds the C++ parts (setup.py rejects bad values)."""
    return os.environ.get("RECSHIP_BUILD_CPP", "").strip() != "0"


def get_requires_for_build_wheel(config_settings=None) -> List[str]:
    requires = list(_setuptools.get_requires_for_build_wheel(config_settings))
    return requires + cpp_requirements() if _builds_cpp() else requires
