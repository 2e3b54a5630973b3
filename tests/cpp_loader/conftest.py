"""The C++ loader built once for the folder's tests (cpp_loader/build.py: cmake, incremental)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def binary():
    """Path of the built recship_predict."""
    spec = importlib.util.spec_from_file_location("cpp_build", ROOT / "cpp_loader" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build() / "recship_predict"
