"""The type checker runs over every package (mypy, basic settings, pinned in the dev extra).

recship's subpackages live in top-level folders mapped by setuptools' package-dir, which
mypy cannot follow through the editable install; the test lays the package out as it is
installed (symlinks under tmp) and checks that.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["sparse", "modules", "trainer", "quantize", "export", "models", "serving"]


def test_mypy_finds_no_errors(tmp_path):
    package = tmp_path / "recship"
    package.mkdir()
    for f in (ROOT / "recship").iterdir():  # its modules and its own subpackages (datasets, metrics)
        if f.suffix == ".py" or (f / "__init__.py").exists():
            (package / f.name).symlink_to(f, target_is_directory=f.is_dir())
    for name in SUBPACKAGES:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"), "recship"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_every_parameter_of_a_public_function_is_annotated():
    """Public functions and methods (names without a leading underscore, in public classes) of
    every package annotate all their parameters (self and cls aside)."""
    import ast

    missing = []
    for folder in ["recship", *SUBPACKAGES]:
        for path in (ROOT / folder).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts:  # generated gRPC stubs
                continue
            stack = [ast.parse(path.read_text()).body]
            while stack:
                for node in stack.pop():
                    if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                        stack.append(node.body)
                    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                        a = node.args
                        params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
                        bare = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
                        if bare:
                            missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(bare)})")
    assert missing == []
