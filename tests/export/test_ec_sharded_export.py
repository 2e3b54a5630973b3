"""A two-tower model whose history EmbeddingCollection trains sharded (row-wise, beside its row-wise
EmbeddingBagCollections) on 2 gloo ranks exports from its DCP checkpoint (``recship export``'s pipeline): the
artifact's outputs equal the trained model's eval outputs, bitwise at fp32 and within int8's error."""

import numpy as np
import pytest
import torch

from gloo_ranks import run_ranks
from model_requests import in_process
from recship.export import ExportConfig, export_model
from recship.export.artifact import open_artifact
from recship.sparse import KeyedJaggedTensor
from recship.trainer.checkpoint import save_checkpoint
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recship.trainer.fused_optim import EmbOptimType
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

ARGS = {"num_users": 40, "num_items": 60, "num_countries": 8, "num_categories": 12, "dim": 8, "num_dense": 4}
ROWS = {"user": 40, "country": 8, "history": 60, "item": 60, "category": 12}
BATCH = 6


def request(seed: int):
    """({feature: [ids per example]}, dense [B, 4]): 0-4 history ids per example, one id for the other features."""
    g = np.random.default_rng(seed)
    sparse = {f: [g.integers(0, rows, size=g.integers(0, 5) if f == "history" else 1).tolist() for _ in range(BATCH)]
              for f, rows in ROWS.items()}
    return sparse, g.random((BATCH, 4), dtype=np.float32)


def kjt_of(sparse) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=list(sparse), values=torch.tensor([i for r in sparse.values() for b in r for i in b], dtype=torch.int64),
                             lengths=torch.tensor([len(b) for r in sparse.values() for b in r], dtype=torch.int32))


def _train_worker(rank: int, world_size: int, root: str):
    from recship.models import TwoTower

    torch.manual_seed(0)
    model = TwoTower(**ARGS)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharders = [EmbeddingBagCollectionSharder(fused), EmbeddingCollectionSharder(fused)]
    constraints = {t: ParameterConstraints(sharding_types=["row_wise"])
                   for t in ("user_ids", "country_ids", "history_items", "item_ids", "category_ids")}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints, debug=False).collective_plan(model, sharders)
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders)
    dense_opt = torch.optim.Adagrad(dmp.dense_parameters(), lr=0.05)
    for step in range(4):
        sparse, dense = request(1000 * step + rank)
        outputs = dmp(torch.from_numpy(dense), kjt_of(sparse))
        model_loss = dmp.module.loss(outputs, torch.tensor([float(len(h) % 2) for h in sparse["history"]]))
        model_loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
    path = save_checkpoint(root, 4, dmp, dense_opt, config={"entry_point": {"model": "recship.models:TwoTower", "args": ARGS}})
    dmp.eval()
    sparse, dense = request(77 + rank)
    with torch.no_grad():
        outputs = dmp(torch.from_numpy(dense), kjt_of(sparse))
    return {"path": str(path), "type": type(dmp.module.history).__name__, "sparse": sparse, "dense": dense,
            "outputs": {k: v.numpy() for k, v in outputs.items()}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ec-export")
    return root, run_ranks(_train_worker, 2, str(root / "checkpoints"))


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_artifact_answers_as_the_sharded_trained_model(trained, dtype):
    root, results = trained
    assert results[0]["type"] == "ShardedEmbeddingCollection"
    out = root / dtype
    manifest = export_model(results[0]["path"], ExportConfig(out=str(out), dtype=dtype, progress=False, format="torchscript",
                                                             validation_batches=1, validation_batch_size=16))
    names = [f["name"] for f in manifest["sparse_features"]]
    model, _ = open_artifact(out)
    for r in results:  # each rank's eval batch
        got = in_process(model, {n: r["sparse"][n] for n in names}, r["dense"], names=names)
        for key, want in r["outputs"].items():
            if dtype == "fp32":
                np.testing.assert_array_equal(got[key], want, err_msg=key)
            else:  # int8 rows: error ~5e-3 of the rows' scale (STACK.md), through the towers
                np.testing.assert_allclose(got[key], want, rtol=0, atol=0.05 * float(np.abs(want).max()), err_msg=key)
