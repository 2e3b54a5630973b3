"""Only here to generate the gRPC stubs during the build; all metadata is in pyproject.toml."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithProtos(build_py):
    """Runs serving/codegen.py (protos/ -> serving/v1/*_pb2*.py) before the modules are collected."""

    def run(self):
        spec = importlib.util.spec_from_file_location("recship_codegen", Path(__file__).parent / "serving" / "codegen.py")
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)
        codegen.generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
