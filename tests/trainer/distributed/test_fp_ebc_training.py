"""A FeatureProcessedEmbeddingBagCollection (position weights) trains under DistributedModelParallel on 2 gloo ranks
like one process: its tables sharded as any EmbeddingBagCollection's (row-wise and table-wise, the plan keyed by the
FP-EBC's path as TorchRec's is, or planned by the planner), its position weights dense parameters of the dense optimizer.
The reference is plain PyTorch on the whole batches: each id's row times the position weight at its place in its bag,
summed per bag, then a linear layer; SGD on everything."""

from typing import Dict

import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.distributed import (EmbeddingBagCollectionSharder, FeatureProcessedEmbeddingBagCollectionSharder, ShardingPlan,
                                 construct_module_sharding_plan, row_wise, table_wise)
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection, PositionWeightedModuleCollection
from recship.trainer.fused_optim import EmbOptimType
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import EmbeddingShardingPlanner, Topology

LOCAL_BATCH, LR, STEPS = 4, 0.1, 3
MAX = {"a": 4, "b": 5, "c": 4}
ROWS = {"a": 12, "b": 12, "c": 9}
TABLE = {"a": "t0", "b": "t0", "c": "t1"}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=12, feature_names=["a", "b"]),
                                      EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=9, feature_names=["c"])],
                                     is_weighted=True)
        self.fp = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection(MAX))
        self.out = nn.Linear(16, 1)
        with torch.no_grad():
            for w in self.fp._feature_processors.position_weights.values():
                w.copy_(torch.rand(w.shape) + 0.5)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.out(self.fp(kjt).values())


def _batch(step: int, first: int, count: int, world_size: int):
    g = torch.Generator().manual_seed(100 + step)
    n = world_size * LOCAL_BATCH
    lengths = torch.randint(0, 5, (3, n), generator=g)
    ids = [[torch.randint(0, ROWS[f], (int(k),), generator=g) for k in lengths[i]] for i, f in enumerate(MAX)]
    target = torch.randn(n, 1, generator=g)
    pick = slice(first, first + count)
    values = torch.cat([torch.cat(ids[i][pick]) for i in range(3)])
    kjt = KeyedJaggedTensor(keys=list(MAX), values=values, lengths=torch.cat([lengths[i][pick] for i in range(3)]).int())
    return kjt, target[pick]


def _worker(rank: int, world_size: int, how: str) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    ebc_sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    sharders = [FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder)]
    if how == "torchrec_plan":  # TorchRec's way: the FP-EBC's tables under the FP-EBC's own path
        plan = ShardingPlan({"fp": construct_module_sharding_plan(model.fp, {"t0": row_wise(), "t1": table_wise(rank=1)},
                                                                  local_size=world_size, world_size=world_size, device_type="cpu")})
    else:
        plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), debug=False).collective_plan(model, sharders)
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders)
    dense = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    for step in range(STEPS):
        kjt, target = _batch(step, rank * LOCAL_BATCH, LOCAL_BATCH, world_size)
        nn.functional.mse_loss(dmp(kjt), target).backward()
        dense.step()
        dense.zero_grad()
    fp = dmp.module.fp
    sharded = fp._embedding_bag_collection
    out = {f"pw.{k}": v.detach().clone() for k, v in fp._feature_processors.position_weights.items()}
    out.update({t: sharded.gather_table(t) for t in ("t0", "t1")})
    out["out"] = dmp.module.out.weight.detach().clone()
    out["dense_names"] = sorted(n for n, p in dmp.named_parameters() if any(p is q for q in dmp.dense_parameters()))
    out["keys"] = sorted(dmp.state_dict())
    return out


def _reference() -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    tables = {t: nn.Parameter(model.fp._embedding_bag_collection.embedding_bags[t].weight.detach().clone()) for t in ("t0", "t1")}
    pw = {f: nn.Parameter(w.detach().clone()) for f, w in model.fp._feature_processors.position_weights.items()}
    out = nn.Linear(16, 1)
    out.load_state_dict(model.out.state_dict())
    opt = torch.optim.SGD([*tables.values(), *pw.values(), *out.parameters()], lr=LR)
    for step in range(STEPS):
        kjt, target = _batch(step, 0, 2 * LOCAL_BATCH, 2)
        pooled = []
        for f, jt in kjt.to_dict().items():
            rows, start = [], 0
            for n in jt.lengths().tolist():
                ids = jt.values()[start:start + n]
                start += n
                rows.append(sum((pw[f][j] * tables[TABLE[f]][ids[j]] for j in range(n)), torch.zeros(tables[TABLE[f]].shape[1])))
            pooled.append(torch.stack(rows))
        nn.functional.mse_loss(out(torch.cat(pooled, dim=1)), target).backward()
        opt.step()
        opt.zero_grad()
    return {**{f"pw.{f}": w.detach() for f, w in pw.items()}, **{t: w.detach() for t, w in tables.items()}, "out": out.weight.detach()}


def test_fp_ebc_trains_on_two_ranks_like_one_process():
    want = _reference()
    torch.manual_seed(0)
    start = Model()
    assert not torch.equal(want["pw.a"], start.fp._feature_processors.position_weights["a"].detach())  # they trained
    for how in ("torchrec_plan", "planner"):
        results = run_ranks(_worker, 2, how)
        for r, got in enumerate(results):
            for f in MAX:
                torch.testing.assert_close(got[f"pw.{f}"], want[f"pw.{f}"], atol=1e-6, rtol=0, msg=f"{how} rank {r} pw {f}")
            torch.testing.assert_close(got["out"], want["out"], atol=1e-6, rtol=0)
            assert got["dense_names"] == ["fp._feature_processors.position_weights.a", "fp._feature_processors.position_weights.b",
                                          "fp._feature_processors.position_weights.c", "out.bias", "out.weight"]
            assert got["keys"] == ["fp._embedding_bag_collection.embedding_bags.t0.weight",
                                   "fp._embedding_bag_collection.embedding_bags.t1.weight",
                                   "fp._feature_processors.position_weights.a", "fp._feature_processors.position_weights.b",
                                   "fp._feature_processors.position_weights.c", "out.bias", "out.weight"]
        for t in ("t0", "t1"):
            torch.testing.assert_close(results[0][t], want[t], atol=1e-6, rtol=0, msg=f"{how} table {t}")
