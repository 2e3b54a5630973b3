"""The planner's TorchRec arguments (storage_reservation, enumerator, proposer), written as TorchRec users write them
(tests/snippets/torchrec_planner.txt through docs/torchrec.md's import map): the reservation is TorchRec's heuristic
recomputed here by hand, a plan that no longer fits fails with PlannerError naming the table, and the proposers
choose the least-busy plan among the combinations they propose."""

import itertools
import logging

import pytest
import torch
from torch import nn

from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.planner import (EmbeddingShardingPlanner, GreedyProposer, ParameterConstraints, ShardingType, Topology,
                                     shard_cost)
from tutorials.notebook import run_snippet

BIG, SMALL = (100, 16), (10, 8)  # rows, dim
ROWWISE_BYTES = {name: (r * d + r) * 4 for name, (r, d) in {"t_big": BIG, "t_small": SMALL}.items()}  # weights + 1 float/row


@pytest.fixture(scope="module")
def user():
    return run_snippet("torchrec_planner", forbid_torchrec=True)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)  # 20 floats
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t_big", num_embeddings=BIG[0], embedding_dim=BIG[1], feature_names=["a"]),
            EmbeddingBagConfig(name="t_small", num_embeddings=SMALL[0], embedding_dim=SMALL[1], feature_names=["b"]),
        ], device=torch.device("meta"))


def _reserved(cap: int, percentage: float, batch_size: int) -> int:
    """TorchRec's heuristic by hand: margin + 6 x dense parameter bytes + 20 copies of the batch's int64 ids."""
    margin = cap - int((1 - percentage) * cap)
    dense = 6 * 20 * 4
    kjt = 2 * batch_size * 8 * 20  # two tables, pooling factor 1
    return margin + dense + kjt


def test_heuristical_reservation_takes_its_share_and_a_plan_that_no_longer_fits_names_the_table(user):
    model, tables = Model(), sum(ROWWISE_BYTES.values())
    cap = _reserved(0, 0.0, 64) + tables  # exactly enough with no margin
    plan = user["plan_of"](model, user["make_planner"](1, cap, 0.0))
    assert {n: ps.sharding_type for n, ps in plan.get_plan_for_module("ebc").items()} == {"t_big": "table_wise", "t_small": "table_wise"}
    with pytest.raises(user["PlannerError"], match="'t_small'") as e:  # the largest is placed first, the small one no longer fits
        user["plan_of"](model, user["make_planner"](1, cap - 1, 0.0))
    assert e.value.error_type == user["PlannerErrorType"].INSUFFICIENT_STORAGE
    assert "reserved by HeuristicalStorageReservation" in str(e.value)
    # the percentage: 25% of 40000 leaves room, 30% does not
    assert _reserved(40000, 0.25, 64) + tables <= 40000 < _reserved(40000, 0.3, 64) + tables
    user["plan_of"](model, user["make_planner"](1, 40000, 0.25))
    with pytest.raises(user["PlannerError"], match="'t_small'"):
        user["plan_of"](model, user["make_planner"](1, 40000, 0.3))
    # without a reservation the tables alone fit
    EmbeddingShardingPlanner(Topology(1, "cpu", ddr_cap=tables), debug=False).plan(model)
    # a reservation larger than the rank
    with pytest.raises(user["PlannerError"], match="exceeds each rank's capacity") as e:
        user["plan_of"](model, user["make_planner"](1, 10**6, 1.0))
    assert e.value.error_type == user["PlannerErrorType"].INSUFFICIENT_STORAGE


def _cost(plan, batch_size: int, world: int) -> tuple:
    """(busiest rank's cost, total cost) of a plan, from its shards (shard_cost is the planner's documented cost)."""
    cost = [0.0] * world
    for name, ps in plan.get_plan_for_module("ebc").items():
        rows = (BIG if name == "t_big" else SMALL)[0]
        for s in ps.shards:
            cost[s.rank] += shard_cost(s.shard_sizes[0], s.shard_sizes[1], rows, ps.sharding_type, batch_size, world, 1.0, 1)
    return max(cost), sum(cost)


def test_grid_search_keeps_the_least_busy_combination_and_uniform_one_type(user):
    model, batch = Model(), 64
    allowed = {"t_big": ["table_wise", "row_wise"], "t_small": ["table_wise", "column_wise"]}
    constraints = {n: ParameterConstraints(sharding_types=ts) for n, ts in allowed.items()}
    grid = user["plan_of"](model, user["make_planner"](2, 10**9, 0.0, batch, user["GridSearchProposer"](), constraints))
    # every combination planned alone (one type per table), the least busy busiest rank wins, first on ties
    best = None
    for combo in itertools.product(*allowed.values()):
        forced = {n: ParameterConstraints(sharding_types=[st]) for n, st in zip(allowed, combo)}
        alone = EmbeddingShardingPlanner(Topology(2, "cpu"), batch_size=batch, constraints=forced, debug=False).plan(model)
        if best is None or _cost(alone, batch, 2) < _cost(best, batch, 2):
            best = alone
    assert grid == best
    greedy = EmbeddingShardingPlanner(Topology(2, "cpu"), batch_size=batch, constraints=constraints, debug=False).plan(model)
    assert greedy != best and _cost(grid, batch, 2) < _cost(greedy, batch, 2)  # the grid found a plan greedy misses
    # uniform: one type for both tables, the only one both allow
    uniform = user["plan_of"](model, user["make_planner"](2, 10**9, 0.0, batch, user["UniformProposer"](), constraints))
    assert {ps.sharding_type for ps in uniform.get_plan_for_module("ebc").values()} == {ShardingType.TABLE_WISE}
    # grid search over more combinations than max_proposals proposes nothing; greedy beside it still plans
    with pytest.raises(user["PlannerError"], match="no proposer proposed a plan"):
        user["plan_of"](model, user["make_planner"](2, 10**9, 0.0, batch, user["GridSearchProposer"](max_proposals=3), constraints))
    both = [user["GridSearchProposer"](max_proposals=3), user["GreedyProposer"]()]
    assert user["plan_of"](model, user["make_planner"](2, 10**9, 0.0, batch, both, constraints)) == greedy


def test_what_recship_cannot_honour_is_an_error(user):
    with pytest.raises(ValueError, match="partitioner"):
        EmbeddingShardingPlanner(Topology(1, "cpu"), partitioner=object())
    with pytest.raises(ValueError, match="performance_model"):
        EmbeddingShardingPlanner(Topology(1, "cpu"), performance_model=object())
    with pytest.raises(ValueError, match="stats"):
        EmbeddingShardingPlanner(Topology(1, "cpu"), stats=[object()])
    with pytest.raises(ValueError, match="use_depth"):
        GreedyProposer(use_depth=False)
    with pytest.raises(TypeError, match="own proposers"):
        EmbeddingShardingPlanner(Topology(1, "cpu"), proposer=object())
    with pytest.raises(ValueError, match="estimator"):
        user["EmbeddingEnumerator"](Topology(1, "cpu"), 8, estimator=[object()])
    with pytest.raises(ValueError, match="percentage"):
        user["HeuristicalStorageReservation"](percentage=1.5)
    with pytest.raises(TypeError, match="batch_size"):  # recship's old positional order: constraints second
        EmbeddingShardingPlanner(Topology(1, "cpu"), {"t_big": ParameterConstraints()})
    topology = Topology(2, "cpu")
    with pytest.raises(ValueError, match="enumerator's topology"):
        EmbeddingShardingPlanner(Topology(1, "cpu"), enumerator=user["EmbeddingEnumerator"](topology, 8))


def test_debug_logs_the_plan(caplog):
    with caplog.at_level(logging.DEBUG, logger="recship.trainer.planner.planner"):
        plan = EmbeddingShardingPlanner(Topology(2, "cpu"), debug=True).plan(Model())
    assert str(plan) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="recship.trainer.planner.planner"):
        EmbeddingShardingPlanner(Topology(2, "cpu"), debug=False).plan(Model())
    assert "sharding plan" not in caplog.text


def test_topology_takes_torchrecs_positional_order():
    t = Topology(2, "cpu", 1000, 2000)  # world_size, compute_device, hbm_cap, ddr_cap (TorchRec's order)
    assert (t.hbm_cap, t.ddr_cap, t.local_world_size, t.capacity) == (1000, 2000, 2, 2000)
