"""TorchRec's ``torchrec.distributed.sharding_plan`` helpers (through ``recship.distributed``, where the import map
sends that module): a plan written by hand equals the planner's plan of the same choices, and a DMP built from it on
2 gloo ranks trains like one process (reference: plain PyTorch in one process, tests/trainer/distributed/
test_model_parallel.py)."""

import pytest
import torch

from gloo_ranks import run_ranks
from recship.distributed import (ShardingPlan, apply_to_all, column_wise, construct_module_sharding_plan, data_parallel,
                                 row_wise, table_row_wise, table_wise)
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from test_model_parallel import SHARDING, Toy, _single_process, _tables, train_dmp


def _by_hand(model: Toy, planned) -> dict:
    """The plan of SHARDING written with the helpers, on the ranks the planner chose for table- and column-wise."""
    t3_rank = planned["t3"].ranks[0]
    return construct_module_sharding_plan(
        model.sparse, {"t0": row_wise(), "t1": column_wise(ranks=planned["t1"].ranks), "t2": data_parallel(),
                       "t3": table_wise(rank=t3_rank)}, local_size=2, world_size=2, device_type="cpu")


def test_a_plan_by_hand_equals_the_planners_plan_of_the_same_choices():
    model = Toy(device="meta")
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in SHARDING.items()}
    planned = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=constraints).plan(model).get_plan_for_module("sparse")
    assert _by_hand(model, planned) == planned
    every = construct_module_sharding_plan(model.sparse, apply_to_all(model.sparse, row_wise()), world_size=2, device_type="cpu")
    assert sorted(every) == ["t0", "t1", "t2", "t3"] and all(p.sharding_type == "row_wise" for p in every.values())
    assert [(s.shard_offsets, s.shard_sizes, s.rank) for s in every["t0"].shards] == [([0, 0], [6, 8], 0), ([6, 0], [5, 8], 1)]
    hosts = construct_module_sharding_plan(model.sparse, apply_to_all(model.sparse, table_row_wise(host_index=1)), local_size=2,
                                           world_size=4, device_type="cuda")
    assert [(s.rank, s.device) for s in hosts["t0"].shards] == [(2, "cuda:0"), (3, "cuda:1")]
    sized = construct_module_sharding_plan(model.sparse, {**apply_to_all(model.sparse, row_wise()), "t3": row_wise(([2, 4], "cpu"))},
                                           world_size=2, device_type="cpu")
    assert [(s.shard_offsets[0], s.shard_sizes[0]) for s in sized["t3"].shards] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="lacks its tables"):
        construct_module_sharding_plan(model.sparse, {"t0": row_wise()}, world_size=2)
    with pytest.raises(ValueError, match=r"table_wise\(rank=2\)"):
        construct_module_sharding_plan(model.sparse, apply_to_all(model.sparse, table_wise(rank=2)), world_size=2)


def _worker(rank, world_size, steps):
    torch.manual_seed(0)
    model = Toy()
    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in SHARDING.items()}
    planned = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints).plan(Toy(device="meta")).get_plan_for_module("sparse")
    dmp = train_dmp(model, ShardingPlan({"sparse": _by_hand(model, planned)}), rank, world_size, steps)
    sharded = dmp.sharded_modules()[0]
    return {t.name: sharded.gather_table(t.name) for t in _tables() if t.name != "t2"}


def test_a_dmp_from_a_plan_by_hand_trains_like_one_process():
    results = run_ranks(_worker, 2, 3)
    reference = _single_process(2, 3)
    for name, full in results[0].items():
        torch.testing.assert_close(full, reference.sparse.embedding_bags[name].weight.detach(), atol=1e-5, rtol=0)
