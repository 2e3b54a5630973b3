"""DistributedModelParallel on gloo: a toy model (EBC + MLP) trains like one process."""

import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.model_parallel import DistributedModelParallel, in_backward_optimizer_filter
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology
from test_sharded_ebc import LOCAL_BATCH, global_batch

SHARDING = {"t0": ShardingType.ROW_WISE, "t1": ShardingType.COLUMN_WISE, "t2": ShardingType.DATA_PARALLEL, "t3": ShardingType.TABLE_WISE}
LR = 0.1


def _tables():
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=11, embedding_dim=8, feature_names=["f0"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t1", num_embeddings=9, embedding_dim=8, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=4, feature_names=["f2"]),
        EmbeddingBagConfig(name="t3", num_embeddings=6, embedding_dim=4, feature_names=["f3"]),
    ]


class Toy(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.sparse = EmbeddingBagCollection(_tables(), device=device)
        self.over = nn.Sequential(nn.Linear(24, 8, device=device), nn.ReLU(), nn.Linear(8, 1, device=device))

    def forward(self, kjt):
        return self.over(self.sparse(kjt).values())


def _targets(world_size, step):
    return torch.randn(world_size * LOCAL_BATCH, 1, generator=torch.Generator().manual_seed(100 + step))


def _single_process(world_size, steps):
    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        kjt, _ = global_batch(_tables(), world_size, seed=step, weighted=False)
        nn.functional.mse_loss(model(kjt), _targets(world_size, step)).backward()
        opt.step()
        opt.zero_grad()
    return model


def train_dmp(model, plan, rank, world_size, steps):
    """``model`` under DistributedModelParallel with ``plan``, trained ``steps`` steps on this rank's part of the batches
    ``_single_process`` trains on whole (fused EXACT_SGD and dense SGD, both at LR)."""
    dmp = DistributedModelParallel(model, plan=plan, optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_SGD, learning_rate=LR))
    dense_opt = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    for step in range(steps):
        _, local = global_batch(_tables(), world_size, seed=step, weighted=False)
        target = _targets(world_size, step)[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        nn.functional.mse_loss(dmp(local[rank]), target).backward()
        dense_opt.step()
        dense_opt.zero_grad()
    return dmp


def _dmp_worker(rank, world_size, steps):
    torch.manual_seed(0)
    model = Toy()
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in SHARDING.items()}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints).collective_plan(model)
    dmp = train_dmp(model, plan, rank, world_size, steps)
    sharded = dmp.sharded_modules()[0]
    tables = {t.name: sharded.gather_table(t.name) for t in _tables()}
    return {
        "tables": tables,
        "data_parallel": sharded.data_parallel["t2"].detach().clone(),
        "dense": {k: v.detach().clone() for k, v in dmp.unwrapped.over.state_dict().items()},
        "torch_optimizer_params": sorted(n for n, _ in in_backward_optimizer_filter(dmp.named_parameters())),
        "fused_params": sorted(n for n, _ in in_backward_optimizer_filter(dmp.named_parameters(), include=True)),
    }


def test_dmp_trains_like_one_process():
    world_size, steps = 2, 3
    results = run_ranks(_dmp_worker, world_size, steps)
    reference = _single_process(world_size, steps)
    for name, full in results[0]["tables"].items():
        torch.testing.assert_close(full, reference.sparse.embedding_bags[name].weight.detach(), atol=1e-5, rtol=0)
    for r in results:
        for k, v in r["dense"].items():
            torch.testing.assert_close(v, reference.over.state_dict()[k], atol=1e-5, rtol=0)
    # a torch optimizer gets the MLP and the data-parallel table; the fused TBE keeps the rest
    # (named as in the unsharded model, TorchRec's names: DMP's .module is the model without DDP)
    assert results[0]["torch_optimizer_params"] == sorted(
        ["sparse.embedding_bags.t2.weight"] + [f"over.{k}" for k in reference.over.state_dict()]
    )
    assert results[0]["fused_params"] == [f"sparse.embedding_bags.{t}.weight" for t in ("t0", "t1", "t3")]
    # the data-parallel table is identical on every rank
    assert torch.equal(results[0]["data_parallel"], results[1]["data_parallel"])
    assert not torch.equal(results[0]["data_parallel"], Toy().sparse.embedding_bags["t2"].weight.detach())


def _meta_worker(rank, world_size):
    model = Toy(device="meta")
    constraints = {t: ParameterConstraints(sharding_types=[ShardingType.ROW_WISE]) for t in SHARDING}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints).collective_plan(model)
    dmp = DistributedModelParallel(model, plan=plan, optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_SGD))
    shards = dmp.sharded_modules()[0].local_shards()
    return {f"{t}/{s}": tuple(w.shape) for (t, s), w in shards.items()}, [p.is_meta for p in dmp.parameters()]


def test_meta_module_materialises_only_owned_shards():
    results = run_ranks(_meta_worker, 2)
    # row-wise: ceil(rows / 2) rows on rank 0, the rest on rank 1
    assert results[0][0] == {"t0/0": (6, 8), "t1/0": (5, 8), "t2/0": (3, 4), "t3/0": (3, 4)}
    assert results[1][0] == {"t0/1": (5, 8), "t1/1": (4, 8), "t2/1": (2, 4), "t3/1": (3, 4)}
    assert not any(results[0][1]) and not any(results[1][1])


def _plans_made(rank, world_size):
    """How many times this rank ran the planner while DMP planned (with a process group: only rank 0 plans, and
    collective_plan broadcasts its plan)."""
    from recship.trainer.planner import planner as planner_module

    calls = []
    plan = planner_module.EmbeddingShardingPlanner.plan

    def counted(self, *args, **kwargs):
        calls.append(1)
        return plan(self, *args, **kwargs)

    planner_module.EmbeddingShardingPlanner.plan = counted
    try:
        DistributedModelParallel(EmbeddingBagCollection(tables=_tables(), device=torch.device("meta")))
    finally:
        planner_module.EmbeddingShardingPlanner.plan = plan
    return len(calls)


def test_dmp_with_a_process_group_plans_on_rank_0_and_shares_the_plan():
    assert run_ranks(_plans_made, 2) == [1, 0]
