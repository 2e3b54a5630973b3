"""A model holding a FeatureProcessedEmbeddingBagCollection with position weights (tests/export/fp_model.py) goes
train -> export -> serve: trained by `recship train --model` on 2 gloo ranks (its position weights move off their
initial 1), exported from the checkpoint as a user would (its history feature unweighted in the manifest: the model
weights the ids itself), and answered by both fronts and recship_predict bitwise as the artifact in process, which
is close to a plain-PyTorch float reference of the checkpoint (each history id's row times the position weight at
its place in the bag) and far from the same reference without the position weights."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from recship.export.artifact import aoti_runs_here, open_artifact
from recship.trainer.checkpoint_reader import CheckpointReader

from model_requests import ModelInputs, assert_served_as_in_process, in_process, random_request
MAX_HISTORY = 8  # tests/export/fp_model.py: the position weights' length


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(artifact folder, checkpoint): PositionRanker trained on 2 gloo ranks and exported from its checkpoint."""
    from recship.cli import main

    root = tmp_path_factory.mktemp("fp-ebc")
    assert main(["train", "--model", "tests.export.fp_model:build", "--out", str(root / "run"), "--steps", "30", "--batch-size", "32",
                 "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0", "--no-progress", "--nproc-per-node", "2"]) == 0
    checkpoint = sorted((root / "run" / "checkpoints").iterdir())[-1]
    out = root / "artifact"
    done = subprocess.run([sys.executable, "-m", "recship", "export", str(checkpoint), "--out", str(out), "--model-name", "fp",
                           "--validation-batch-size", "64"], capture_output=True, text=True,
                          env={**os.environ, "RECSHIP_AOTI": "1" if shutil.which(os.environ.get("CXX", "g++")) else "0"})
    assert done.returncode == 0, done.stderr
    return out, checkpoint


def _float_reference(checkpoint, sparse, dense, position: bool) -> np.ndarray:
    """[B, 1] of the checkpoint's float weights in plain PyTorch: pooled sums (history ids weighted by position)."""
    reader = CheckpointReader(checkpoint)
    tables = {f"{path}.{cfg.name}": w for path, cfg, w in reader.tables()}
    state = reader.dense_state_dict()
    pw = state["fp._feature_processors.position_weights.history"]
    assert pw.shape == (MAX_HISTORY,)

    def pooled(table: torch.Tensor, bags, weighted: bool) -> torch.Tensor:
        return torch.stack([sum(((pw[j] if weighted else 1.0) * table[i] for j, i in enumerate(bag)), torch.zeros(table.shape[1]))
                            for bag in bags])

    x = torch.cat([torch.from_numpy(np.asarray(dense, dtype=np.float32)), pooled(tables["ebc.t_user"], sparse["user"], False),
                   pooled(tables["ebc.t_item"], sparse["item"], False),
                   pooled(tables["fp._embedding_bag_collection.t_history"], sparse["history"], position)], dim=1)
    h = torch.relu(x @ state["over.0.weight"].T + state["over.0.bias"])
    return (h @ state["over.2.weight"].T + state["over.2.bias"]).numpy()


def test_the_position_weights_trained_and_the_artifact_applies_them(exported):
    out, checkpoint = exported
    pw = CheckpointReader(checkpoint).dense_state_dict()["fp._feature_processors.position_weights.history"]
    assert (pw - 1).abs().max() > 1e-4  # the dense optimizer moved them on both ranks
    model, manifest = open_artifact(out)
    assert {f.name: f.weighted for f in manifest.sparse_features} == {"history": False, "user": False, "item": False}
    sparse, dense, weights = random_request(ModelInputs.of(manifest), 64, 11, ids=(0, MAX_HISTORY))
    assert weights is None
    got = in_process(model, sparse, dense)["output"]
    want = _float_reference(checkpoint, sparse, dense, position=True)
    unweighted = _float_reference(checkpoint, sparse, dense, position=False)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.02 * scale  # INT8 tables
    assert np.abs(unweighted - want).max() > 10 * np.abs(got - want).max()  # the position weights matter here


def _formats(out):
    """The artifact's model files that run here: torchscript (model.pt), and aoti (model.pt2) where it was compiled."""
    _, manifest = open_artifact(out, check=False)
    return ["torchscript"] + (["aoti"] if aoti_runs_here(manifest)[0] else [])


def test_both_fronts_and_recship_predict_answer_as_the_artifact_in_process(exported, binary, tmp_path):
    out, _ = exported
    for fmt in _formats(out):
        model, manifest = open_artifact(out, format=fmt)
        requests = [random_request(ModelInputs.of(manifest), batch, seed, ids=(0, MAX_HISTORY)) for batch, seed in [(1, 1), (7, 2), (300, 3)]]
        assert_served_as_in_process(out, "fp", requests, [in_process(model, *r) for r in requests], binary, tmp_path, model_format=fmt)