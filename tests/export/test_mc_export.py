"""A model holding a ManagedCollisionEmbeddingBagCollection (tests/export/mc_model.py) goes train -> export -> serve:
trained by `recship train --model` on 2 gloo ranks (each rank's modules hand the slots of its rows to the most frequent
ids of its input block every 2 steps), exported from the checkpoint as a user would (fp32 tables; the checkpoint holds
the ranks' remapping buffers gathered, which the unsharded model re-sorts on load), and answered by both fronts and recship_predict bitwise as the artifact in
process. The artifact applies the checkpoint's remapping: it equals a plain-PyTorch float reference that remaps each
raw id with a dict built from the checkpoint's ``_mch_sorted_raw_ids`` / ``_mch_remapped_ids_mapping`` (a raw id
without a slot: the last row), and is far from the same reference looking the raw ids up directly.

The served model takes raw ids in each module's input range, the manifest's id_bound (tests/export/mc_model.py sets
input_hash_size to the rows); tests/export/test_mc_raw_ids.py serves raw ids far above the rows."""

import numpy as np
import pytest
import torch

from recship.export.artifact import open_artifact
from recship.trainer.checkpoint_reader import CheckpointReader

from model_requests import ModelInputs, assert_served_as_in_process, in_process, random_request

PREFIX = "mc._managed_collision_collection._managed_collision_modules."


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(artifact folder, checkpoint): CollisionRanker trained on 2 gloo ranks and exported from its checkpoint."""
    from recship.cli import main

    root = tmp_path_factory.mktemp("mc-ebc")
    assert main(["train", "--model", "tests.export.mc_model:build", "--out", str(root / "run"), "--steps", "8", "--batch-size", "32",
                 "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0", "--no-progress", "--nproc-per-node", "2"]) == 0
    checkpoint = sorted((root / "run" / "checkpoints").iterdir())[-1]
    out = root / "artifact"
    assert main(["export", str(checkpoint), "--out", str(out), "--model-name", "mc", "--dtype", "fp32", "--format", "torchscript",
                 "--validation-batch-size", "64", "--no-plot"]) == 0
    return out, checkpoint


def _float_reference(checkpoint, sparse, dense, remap: bool) -> np.ndarray:
    """[B, 1] of the checkpoint in plain PyTorch: raw ids remapped by dict (or not), pooled sums, the MLP."""
    reader = CheckpointReader(checkpoint)
    tables = {cfg.name: w for _, cfg, w in reader.tables()}
    state = reader.dense_state_dict()
    pooled = [torch.from_numpy(np.asarray(dense, dtype=np.float32))]
    for feature, table in (("user", "t_user"), ("item", "t_item")):
        raw, rows = state[PREFIX + f"{table}._mch_sorted_raw_ids"].tolist(), state[PREFIX + f"{table}._mch_remapped_ids_mapping"].tolist()
        slot = {r: row for r, row in zip(raw, rows) if r != 2**63 - 1}
        weight = tables[table]
        miss = weight.shape[0] - 1
        pooled.append(torch.stack([sum((weight[slot.get(i, miss) if remap else i] for i in bag), torch.zeros(weight.shape[1]))
                                   for bag in sparse[feature]]))
    x = torch.cat(pooled, dim=1)
    h = torch.relu(x @ state["over.0.weight"].T + state["over.0.bias"])
    return (h @ state["over.2.weight"].T + state["over.2.bias"]).numpy()


def test_the_artifact_remaps_ids_as_the_checkpoint_does(exported):
    out, checkpoint = exported
    state = CheckpointReader(checkpoint).dense_state_dict()
    assert int(state[PREFIX + "t_user._current_iter_tensor"]) == 8  # profiled every training step
    assert state[PREFIX + "t_user._output_segments_tensor"][:3].tolist() == [0, 20, 40]  # two row-wise shards
    slots, rows = state[PREFIX + "t_user._mch_sorted_raw_ids"], state[PREFIX + "t_user._mch_remapped_ids_mapping"]
    assert (slots != 2**63 - 1).sum() > 10  # slots went to ids
    # each rank's ids (block 0: raw ids < 20, block 1: the others) took the rows of its shard
    taken = slots != 2**63 - 1
    assert ((slots[taken] < 20) == (rows[taken] < 20)).all()
    model, manifest = open_artifact(out)
    assert {f.name: f.id_bound for f in manifest.sparse_features} == {"user": 40, "item": 32}  # each module's input_hash_size
    sparse, dense, _ = random_request(ModelInputs.of(manifest), 64, 11, ids=(0, 4))
    got = in_process(model, sparse, dense)["output"]
    want = _float_reference(checkpoint, sparse, dense, remap=True)
    raw = _float_reference(checkpoint, sparse, dense, remap=False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(raw - want).max() > 100 * np.abs(got - want).max()  # the remapping matters here


def test_both_fronts_and_recship_predict_answer_as_the_artifact_in_process(exported, binary, tmp_path):
    out, _ = exported
    model, manifest = open_artifact(out, format="torchscript")
    requests = [random_request(ModelInputs.of(manifest), batch, seed, ids=(0, 5)) for batch, seed in [(1, 1), (9, 2), (200, 3)]]
    assert_served_as_in_process(out, "mc", requests, [in_process(model, *r) for r in requests], binary, tmp_path)