"""FusedEmbeddingBagCollectionSharder (TorchRec's): a FusedEmbeddingBagCollection under DistributedModelParallel on 2
gloo ranks trains like one process on the whole batch, its tables sharded (row-wise, table-wise, column-wise, or as
the planner chooses) and updated by the module's own fused optimizer (SGD, Adagrad). The reference is plain PyTorch:
SUM / MEAN bags of the tables' rows, a linear layer, mse loss; torch's SGD / Adagrad on every parameter."""

from typing import Any, Dict

import pytest
import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.distributed import (FusedEmbeddingBagCollectionSharder, ParameterSharding, ShardingPlan, ShardingType,
                                 construct_module_sharding_plan, column_wise, row_wise, table_wise)
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagConfig
from recship.trainer.fused_embedding_modules import FusedEmbeddingBagCollection
from recship.trainer.model_parallel import DistributedModelParallel
from recship.modules.types import PoolingType

LOCAL, STEPS, LR = 3, 3, 0.1
FEATURES = {"a": ("t0", 11), "b": ("t1", 7)}
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": LR}), "adagrad": (torch.optim.Adagrad, {"lr": LR, "eps": 1e-8})}


def _tables():
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=11, feature_names=["a"]),
            EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=7, feature_names=["b"], pooling=PoolingType.MEAN)]


class Model(nn.Module):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        cls, kwargs = OPTIMIZERS[optimizer]
        self.fused = FusedEmbeddingBagCollection(_tables(), cls, kwargs)
        self.out = nn.Linear(12, 1)
        with torch.no_grad():
            for t in ("t0", "t1"):
                self.fused.embedding_bags[t].weight.uniform_(-0.5, 0.5)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.out(self.fused(kjt).values())


def _batch(step: int, first: int, count: int, world_size: int):
    g = torch.Generator().manual_seed(200 + step)
    n = world_size * LOCAL
    lengths = torch.randint(1, 4, (2, n), generator=g)
    ids = [[torch.randint(0, rows, (int(k),), generator=g) for k in lengths[i]] for i, (_, rows) in enumerate(FEATURES.values())]
    target = torch.randn(n, 1, generator=g)
    pick = slice(first, first + count)
    values = torch.cat([torch.cat(ids[i][pick]) for i in range(2)])
    kjt = KeyedJaggedTensor(keys=list(FEATURES), values=values, lengths=torch.cat([lengths[i][pick] for i in range(2)]).int())
    return kjt, target[pick]


def _plan(model: Model, how: str, world_size: int) -> Any:
    if how == "planner":
        return None
    shardings = {"row_wise": {"t0": row_wise(), "t1": row_wise()}, "mixed": {"t0": table_wise(rank=1), "t1": column_wise(ranks=[0, 1])}}[how]
    return ShardingPlan({"fused": construct_module_sharding_plan(model.fused, shardings, local_size=world_size, world_size=world_size,
                                                                 device_type="cpu", sharder=FusedEmbeddingBagCollectionSharder())})


def _worker(rank: int, world_size: int, optimizer: str, how: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = Model(optimizer)
    dmp = DistributedModelParallel(model, plan=_plan(model, how, world_size), sharders=[FusedEmbeddingBagCollectionSharder()])
    cls, kwargs = OPTIMIZERS[optimizer]
    dense = cls(dmp.dense_parameters(), **kwargs)
    for step in range(STEPS):
        kjt, target = _batch(step, rank * LOCAL, LOCAL, world_size)
        nn.functional.mse_loss(dmp(kjt), target).backward()
        dense.step()
        dense.zero_grad()
    sharded = dmp.module.fused
    return {"type": type(sharded).__name__, "t0": sharded.gather_table("t0"), "t1": sharded.gather_table("t1"),
            "out": dmp.module.out.weight.detach().clone(), "keys": sorted(dmp.state_dict()),
            "plan": {t: ps.sharding_type.value for t, ps in dmp.plan.get_plan_for_module("fused").items()}}


def _reference(optimizer: str) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model(optimizer)
    tables = {t: nn.Parameter(model.fused.embedding_bags[t].weight.detach().clone()) for t in ("t0", "t1")}
    out = nn.Linear(12, 1)
    out.load_state_dict(model.out.state_dict())
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls([*tables.values(), *out.parameters()], **kwargs)
    for step in range(STEPS):
        kjt, target = _batch(step, 0, 2 * LOCAL, 2)
        pooled = []
        for f, jt in kjt.to_dict().items():
            table = tables[FEATURES[f][0]]
            bags = torch.split(jt.values(), jt.lengths().tolist())
            pooled.append(torch.stack([table[b].sum(0) if f == "a" else table[b].mean(0) for b in bags]))
        nn.functional.mse_loss(out(torch.cat(pooled, dim=1)), target).backward()
        opt.step()
        opt.zero_grad()
    return {"t0": tables["t0"].detach(), "t1": tables["t1"].detach(), "out": out.weight.detach()}


CASES = [("sgd", "row_wise"), ("adagrad", "mixed"), ("sgd", "planner")]


def _all_cases(rank: int, world_size: int) -> Dict[str, Any]:
    return {case: _worker(rank, world_size, *case) for case in CASES}  # one spawn for all: fbgemm loads once per rank


def test_fused_ebc_trains_on_two_ranks_like_one_process():
    results = run_ranks(_all_cases, 2)
    for optimizer, how in CASES:
        want = _reference(optimizer)
        torch.manual_seed(0)
        start = Model(optimizer)
        assert not torch.allclose(want["t0"], start.fused.embedding_bags["t0"].weight.detach())  # the tables trained
        for r, per_case in enumerate(results):
            got = per_case[(optimizer, how)]
            assert got["type"] == "ShardedFusedEmbeddingBagCollection"
            assert got["keys"] == ["fused.embedding_bags.t0.weight", "fused.embedding_bags.t1.weight", "out.bias", "out.weight"]
            torch.testing.assert_close(got["out"], want["out"], atol=1e-5, rtol=0, msg=f"{optimizer} {how} rank {r} out")
            if how == "mixed":
                assert got["plan"] == {"t0": "table_wise", "t1": "column_wise"}
        for t in ("t0", "t1"):
            torch.testing.assert_close(results[0][(optimizer, how)][t], want[t], atol=1e-5, rtol=0, msg=f"{optimizer} {how} table {t}")


def test_sharder_refusals_and_vocabulary():
    sharder = FusedEmbeddingBagCollectionSharder()
    fused = FusedEmbeddingBagCollection(_tables(), torch.optim.SGD, {"lr": LR})
    assert sharder.module_type is FusedEmbeddingBagCollection
    assert sorted(sharder.shardable_parameters(fused)) == ["t0", "t1"]
    assert sharder.shardable_parameters(fused)["t0"] is fused.embedding_bags["t0"].weight
    assert "data_parallel" not in sharder.sharding_types("cpu") and "row_wise" in sharder.sharding_types("cpu")
    assert sharder.compute_kernels("table_wise", "cpu") == ["fused"]
    with pytest.raises(ValueError, match="own optimizer"):
        FusedEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.5})
    from recship.trainer.distributed.fused_sharder import ShardedFusedEmbeddingBagCollection
    from recship.distributed import ShardingEnv

    dp = {"t0": ParameterSharding(ShardingType.DATA_PARALLEL, "dense", [0, 1], None),
          "t1": ParameterSharding(ShardingType.DATA_PARALLEL, "dense", [0, 1], None)}
    with pytest.raises(ValueError, match="data_parallel"):
        ShardedFusedEmbeddingBagCollection(fused, dp, ShardingEnv.from_local(1, 0))
    with pytest.raises(TypeError, match="FusedEmbeddingBagCollection"):
        ShardedFusedEmbeddingBagCollection(nn.Linear(2, 2), {}, ShardingEnv.from_local(1, 0))
