"""TorchRec's DLRMTrain(DLRM) under recship's DistributedModelParallel on 2 gloo ranks, as TorchRec's training
examples drive it (``loss, (loss, logits, labels) = dmp(batch)``): tables row-, column-, table-wise and
data-parallel; it trains like the same model in one process on the whole batch."""

import torch

from gloo_ranks import run_ranks
from recship.datasets import Batch
from recship.models.dlrm import DLRM, DLRMTrain
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology

LOCAL_BATCH, NUM_DENSE, LR, STEPS = 3, 4, 0.1, 3
SHARDING = {"ta": ShardingType.ROW_WISE, "tb": ShardingType.COLUMN_WISE, "tc": ShardingType.TABLE_WISE,
            "td": ShardingType.DATA_PARALLEL}


def _tables():
    return [EmbeddingBagConfig(name="ta", num_embeddings=13, embedding_dim=8, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="tb", num_embeddings=10, embedding_dim=8, feature_names=["f2"]),
            EmbeddingBagConfig(name="tc", num_embeddings=7, embedding_dim=8, feature_names=["f3"]),
            EmbeddingBagConfig(name="td", num_embeddings=5, embedding_dim=8, feature_names=["f4"])]


def _model():
    torch.manual_seed(0)
    return DLRMTrain(DLRM(EmbeddingBagCollection(_tables()), NUM_DENSE, [8, 8], [8, 1]))


def _batch(step, lo, hi):
    """Examples lo..hi of step's global batch of 2 * LOCAL_BATCH."""
    g = torch.Generator().manual_seed(step)
    n = 2 * LOCAL_BATCH
    keys = [f for t in _tables() for f in t.feature_names]
    rows = {f: t.num_embeddings for t in _tables() for f in t.feature_names}
    lengths, values = [], []
    for k in keys:
        l = torch.randint(0, 4, (n,), generator=g)
        ids = torch.randint(0, rows[k], (int(l.sum()),), generator=g)
        lengths.append(l[lo:hi])
        values.append(ids[int(l[:lo].sum()) : int(l[:hi].sum())])
    dense = torch.rand(n, NUM_DENSE, generator=g)[lo:hi]
    labels = torch.randint(0, 2, (n,), generator=g)[lo:hi]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def _worker(rank, world_size):
    model = _model()
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in SHARDING.items()}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints).collective_plan(model)
    dmp = DistributedModelParallel(model, plan=plan, optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_SGD, learning_rate=LR))
    dense_opt = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    logits = []
    for step in range(STEPS):
        loss, (detached, step_logits, labels) = dmp(_batch(step, rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH))
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        logits.append(step_logits)
    sharded = dmp.sharded_modules()[0]
    tables = {t.name: sharded.gather_table(t.name) for t in _tables() if t.name != "td"}
    dlrm = dmp.module.model
    dense = {k: v.detach().clone() for k, v in {**dlrm.dense_arch.state_dict(), **dlrm.over_arch.state_dict()}.items()}
    data_parallel = sharded.data_parallel["td"].detach().clone()
    return {"logits": logits, "tables": tables, "dense": dense, "td": data_parallel}


def test_dlrm_train_under_dmp_trains_like_one_process():
    results = run_ranks(_worker, 2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss, (_, logits, _) = model(_batch(step, 0, 2 * LOCAL_BATCH))
        torch.testing.assert_close(torch.cat([r["logits"][step] for r in results]), logits, atol=1e-5, rtol=0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dlrm = model.model
    bags = dlrm.sparse_arch.embedding_bag_collection.embedding_bags
    for name, full in results[0]["tables"].items():
        torch.testing.assert_close(full, bags[name].weight.detach(), atol=1e-5, rtol=0)
    expected = {**dlrm.dense_arch.state_dict(), **dlrm.over_arch.state_dict()}
    for r in results:
        assert r["dense"].keys() == expected.keys()
        for k, v in r["dense"].items():
            torch.testing.assert_close(v, expected[k], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["td"], bags["td"].weight.detach(), atol=1e-5, rtol=0)
    assert not torch.equal(results[0]["tables"]["ta"], _model().model.sparse_arch.embedding_bag_collection.embedding_bags["ta"].weight)
