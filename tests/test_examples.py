"""examples/my_model.py, the README's "Bring your own model" file, runs as documented and answers correctly."""

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from recship.export.artifact import load_artifact

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_trains_exports_and_serves_from_the_repository_root(tmp_path):
    result = subprocess.run([sys.executable, "examples/my_model.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    model, manifest = load_artifact(tmp_path / "repo" / "my_model" / "1")
    assert [f["name"] for f in manifest["sparse_features"]] == ["video", "channel"]
    assert manifest["model"]["entry_point"] == {"model": "examples.my_model:build", "args": {"videos": 500, "channels": 50}}
    with torch.no_grad():  # the request the example sends: video [3, 17], channel [5], dense [2, 0, 7]
        want = model(torch.tensor([[2.0, 0.0, 7.0]]), torch.tensor([2, 1], dtype=torch.int32), torch.tensor([3, 17, 5]), None)
    np.testing.assert_array_equal(np.array(answer["output"], dtype=np.float32), want["output"].numpy())
