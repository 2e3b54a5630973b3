"""The type checker runs over every package (mypy, basic settings, pinned in the dev extra).

recship's subpackages live in top-level folders mapped by setuptools' package-dir, which
mypy cannot follow through the editable install; the test lays the package out as it is
installed (symlinks under tmp) and checks that.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["sparse", "trainer", "quantize", "export", "models", "serving"]


def test_mypy_finds_no_errors(tmp_path):
    package = tmp_path / "recship"
    package.mkdir()
    for f in (ROOT / "recship").glob("*.py"):
        (package / f.name).symlink_to(f)
    for name in SUBPACKAGES:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"), "recship"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
