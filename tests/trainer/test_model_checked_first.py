"""A wrong ``recship train --model`` costs its one line before the trainer, fbgemm_gpu or any rank loads: it took ~54 s
on a busy machine, the time to import all of them, before the line that a module or a factory does not exist.

The work is counted, not timed: the process that gives the error never imported the trainer or fbgemm_gpu, and
wrote nothing under --out."""

import json
import subprocess
import sys

import pytest

# runs `recship train ARGS...`, then says which of the heavy modules the process had imported
SCRIPT = """
import json, sys
from recship.cli import main
code = main(sys.argv[1:])
print(json.dumps(sorted(m for m in ("fbgemm_gpu", "recship.trainer.train") if m in sys.modules)))
sys.exit(code)
"""


@pytest.mark.parametrize("entry,message", [
    ("/nonexistent.py:build", "--model /nonexistent.py:build: cannot import /nonexistent.py: ModuleNotFoundError"),
    ("no_such_module_41:build", "--model no_such_module_41:build: cannot import no_such_module_41: ModuleNotFoundError"),
    ("user_model:build", "--model user_model:build: user_model has no build"),
    ("user_model:TABLES", "--model user_model:TABLES: TABLES is a list, not a callable"),
])
def test_a_wrong_model_is_one_line_before_the_trainer_loads(tmp_path, entry, message):
    (tmp_path / "user_model.py").write_text("TABLES = []\n\n\ndef buidl():\n    pass\n")  # importable from the current directory
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", SCRIPT, "train", "--model", entry, "--out", str(out), "--steps", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"recship train: error: {message}"), done.stderr
    assert json.loads(done.stdout) == []  # neither the trainer nor fbgemm_gpu was imported
    assert not out.exists()  # no rank started, nothing written


def test_a_file_path_is_told_that_an_entry_point_names_a_module(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.py").write_text("def build():\n    pass\n")
    done = subprocess.run([sys.executable, "-c", SCRIPT, "train", "--model", "models/mine.py:build", "--out", str(tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "an entry point names a module, not a file" in done.stderr and "module:factory" in done.stderr, done.stderr
    assert json.loads(done.stdout) == []
