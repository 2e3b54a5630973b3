"""A model holding an EmbeddingCollection (recship.models:TwoTower: the user's history of item ids, unpooled lookups)
goes train -> export -> serve: trained by `recship train --model` on 2 gloo ranks, where the planner shards the
history table row-wise (each rank owns half its rows; the checkpoint records the plan), exported from that checkpoint
as a user would (fp32 tables), and answered by both fronts and recship_predict bitwise as the artifact in process,
which equals a plain-PyTorch float reference of the checkpoint (the history rows mean-pooled per example) and is far
from the same reference without the history."""

import json

import numpy as np
import pytest
import torch

from recship.export.artifact import open_artifact
from recship.trainer.checkpoint_reader import CheckpointReader

from model_requests import ModelInputs, assert_served_as_in_process, in_process, random_request

ARGS = {"num_users": 40, "num_items": 120, "num_countries": 8, "num_categories": 12, "dim": 8, "num_dense": 4}
OUTPUTS = ("score", "user_embedding", "item_embedding")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(artifact folder, checkpoint): TwoTower trained on 2 gloo ranks and exported from its checkpoint."""
    from recship.cli import main

    root = tmp_path_factory.mktemp("ec-train")
    assert main(["train", "--model", "recship.models:TwoTower", "--model-args", json.dumps(ARGS), "--out", str(root / "run"),
                 "--steps", "12", "--batch-size", "32", "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0",
                 "--no-progress", "--no-plot", "--nproc-per-node", "2"]) == 0
    checkpoint = sorted((root / "run" / "checkpoints").iterdir())[-1]
    out = root / "artifact"
    assert main(["export", str(checkpoint), "--out", str(out), "--model-name", "tt", "--dtype", "fp32", "--format", "torchscript",
                 "--validation-batch-size", "64", "--no-plot"]) == 0
    return out, checkpoint


def _float_reference(checkpoint, sparse, dense, history: bool = True) -> dict:
    """{output: array} of the checkpoint in plain PyTorch: pooled sums (category: mean), the history's rows averaged
    per example (left out with ``history=False``), log1p of the dense counts, the two towers, their dot product."""
    reader = CheckpointReader(checkpoint)
    tables = {f"{path}.{cfg.name}": w for path, cfg, w in reader.tables()}
    state = reader.dense_state_dict()
    rows = state["history.embeddings.history_items.weight"]  # the row-wise table, gathered whole

    def pooled(table: torch.Tensor, bags, mean: bool = False) -> torch.Tensor:
        return torch.stack([sum((table[i] for i in bag), torch.zeros(table.shape[1])) / (max(len(bag), 1) if mean else 1)
                            for bag in bags])

    def mlp(x: torch.Tensor, name: str) -> torch.Tensor:
        h = torch.relu(x @ state[f"{name}.0.weight"].T + state[f"{name}.0.bias"])
        return h @ state[f"{name}.2.weight"].T + state[f"{name}.2.bias"]

    seen = pooled(rows, sparse["history"], mean=True) if history else torch.zeros(len(sparse["history"]), rows.shape[1])
    counts = torch.log1p(torch.from_numpy(np.asarray(dense, dtype=np.float32)).clamp(min=0))
    user = mlp(torch.cat([pooled(tables["user_tables.user_ids"], sparse["user"]),
                          pooled(tables["user_tables.country_ids"], sparse["country"]), seen, counts], dim=1), "user_mlp")
    item = mlp(torch.cat([pooled(tables["item_tables.item_ids"], sparse["item"]),
                          pooled(tables["item_tables.category_ids"], sparse["category"], mean=True)], dim=1), "item_mlp")
    return {"score": (user * item).sum(dim=1, keepdim=True).numpy(), "user_embedding": user.numpy(), "item_embedding": item.numpy()}


def test_the_history_table_trained_row_wise_and_the_artifact_equals_the_checkpoint(exported):
    out, checkpoint = exported
    reader = CheckpointReader(checkpoint)
    assert reader.meta["world_size"] == 2
    assert reader.meta["tables"]["history/history_items"]["sharding_type"] == "row_wise"  # the planner's choice
    shards = reader.plan.get_plan_for_module("history")["history_items"]
    assert shards.sharding_type == "row_wise" and [s.placement.rank() for s in shards.sharding_spec.shards] == [0, 1]
    assert [s.shard_sizes for s in shards.sharding_spec.shards] == [[60, 8], [60, 8]]
    model, manifest = open_artifact(out)
    assert {f.name: f.pooling for f in manifest.sparse_features}["history"] == "NONE"
    sparse, dense, _ = random_request(ModelInputs.of(manifest), 64, 11, ids=(0, 4))
    got = in_process(model, sparse, dense)
    want = _float_reference(checkpoint, sparse, dense)
    without = _float_reference(checkpoint, sparse, dense, history=False)
    for key in OUTPUTS:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    err = np.abs(got["user_embedding"] - want["user_embedding"]).max()
    assert np.abs(without["user_embedding"] - want["user_embedding"]).max() > 100 * max(err, 1e-7)  # the history matters here


def test_both_fronts_and_recship_predict_answer_as_the_artifact_in_process(exported, binary, tmp_path):
    out, _ = exported
    model, manifest = open_artifact(out, format="torchscript")
    requests = [random_request(ModelInputs.of(manifest), batch, seed, ids=(0, 5)) for batch, seed in [(1, 1), (9, 2), (200, 3)]]
    wants = [in_process(model, *r) for r in requests]
    assert all(set(want) == set(OUTPUTS) for want in wants)
    assert_served_as_in_process(out, "tt", requests, wants, binary, tmp_path)