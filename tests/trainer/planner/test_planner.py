import pytest
import torch

from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingPlan,
    ShardingType,
    Topology,
)


def tutorial_ebc():
    """The tutorial's 4 tables: two 'large' 4096 x 64, two 'small' 1024 x 64 (on meta)."""
    sizes = {"large_0": 4096, "large_1": 4096, "small_0": 1024, "small_1": 1024}
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=64) for n, r in sizes.items()], device="meta"
    )


def forced(st, tables=("large_0", "large_1", "small_0", "small_1")):
    return {t: ParameterConstraints(sharding_types=[st]) for t in tables}


def assert_tiles(plan, ebc):
    """Every table's shards cover it exactly once (checked cell by cell)."""
    for t in ebc.embedding_bag_configs():
        ps = plan.get_plan_for_module("")[t.name]
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            continue
        cover = torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.int64)
        for s in ps.shards:
            (r, c), (n, w) = s.shard_offsets, s.shard_sizes
            cover[r : r + n, c : c + w] += 1
        assert bool((cover == 1).all()), t.name


def test_tutorial_row_wise_gives_2048_rows_per_rank():
    ebc = tutorial_ebc()
    plan = EmbeddingShardingPlanner(Topology(2), forced(ShardingType.ROW_WISE)).plan(ebc)
    assert_tiles(plan, ebc)
    for name in ("large_0", "large_1"):
        shards = plan.get_plan_for_module("")[name].shards
        assert [(s.rank, s.shard_offsets, s.shard_sizes) for s in shards] == [(0, [0, 0], [2048, 64]), (1, [2048, 0], [2048, 64])]


def test_tutorial_column_wise_gives_32_columns_per_rank():
    ebc = tutorial_ebc()
    plan = EmbeddingShardingPlanner(Topology(2), forced(ShardingType.COLUMN_WISE)).plan(ebc)
    assert_tiles(plan, ebc)
    for ps in plan.get_plan_for_module("").values():
        assert sorted(s.rank for s in ps.shards) == [0, 1]
        assert [s.shard_sizes for s in ps.shards] == [[ps.shards[0].shard_sizes[0], 32]] * 2


def test_tutorial_table_wise_balances_one_large_and_one_small_per_rank():
    ebc = tutorial_ebc()
    plan = EmbeddingShardingPlanner(Topology(2), forced(ShardingType.TABLE_WISE)).plan(ebc).get_plan_for_module("")
    by_rank = {0: set(), 1: set()}
    for name, ps in plan.items():
        assert len(ps.shards) == 1 and ps.shards[0].shard_sizes == [4096 if "large" in name else 1024, 64]
        by_rank[ps.ranks[0]].add(name.split("_")[0])
    assert by_rank == {0: {"large", "small"}, 1: {"large", "small"}}


def test_table_row_wise_stays_inside_one_host():
    ebc = tutorial_ebc()
    plan = EmbeddingShardingPlanner(Topology(4, local_world_size=2), forced(ShardingType.TABLE_ROW_WISE)).plan(ebc)
    assert_tiles(plan, ebc)
    hosts = set()
    for name, ps in plan.get_plan_for_module("").items():
        host = {s.rank // 2 for s in ps.shards}
        assert len(host) == 1
        hosts |= host
        if "large" in name:
            assert [s.shard_sizes[0] for s in ps.shards] == [2048, 2048]
    assert hosts == {0, 1}  # the tables are spread over both hosts


def test_data_parallel_replicates_on_every_rank():
    ebc = tutorial_ebc()
    plan = EmbeddingShardingPlanner(Topology(3), forced(ShardingType.DATA_PARALLEL)).plan(ebc)
    for ps in plan.get_plan_for_module("").values():
        assert ps.ranks == [0, 1, 2] and ps.compute_kernel.value == "dense"
        assert all(s.shard_sizes == [ps.shards[0].shard_sizes[0], 64] for s in ps.shards)


@pytest.mark.parametrize("rows, expect", [(10, [4, 4, 2]), (2, [1, 1]), (9, [3, 3, 3])])
def test_uneven_row_splits_for_world_size_3(rows, expect):
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=8)], device="meta")
    plan = EmbeddingShardingPlanner(Topology(3), forced(ShardingType.ROW_WISE, ["t"])).plan(ebc)
    assert_tiles(plan, ebc)
    assert [s.shard_sizes[0] for s in plan.get_plan_for_module("")["t"].shards] == expect


def test_default_plan_tiles_and_json_round_trips(tmp_path):
    ebc = tutorial_ebc()
    plan = EmbeddingShardingPlanner(Topology(3)).plan(ebc)
    assert_tiles(plan, ebc)
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == plan
    text = str(plan)
    assert "param   | sharding type | compute kernel | ranks" in text
    shard_rows = [l for l in text.splitlines() if "rank:" in l]
    assert len(shard_rows) == sum(len(ps.shards) for ps in plan.get_plan_for_module("").values())


def test_memory_counts_optimizer_state():
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8)], device="meta")
    weights = 100 * 8 * 4
    sgd = FusedOptimizerConfig(EmbOptimType.EXACT_SGD)
    adagrad = FusedOptimizerConfig(EmbOptimType.EXACT_ADAGRAD)
    rowwise = FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    tw = forced(ShardingType.TABLE_WISE, ["t"])
    EmbeddingShardingPlanner(Topology(1, ddr_cap=weights), tw, sgd).plan(ebc)
    EmbeddingShardingPlanner(Topology(1, ddr_cap=weights + 100 * 4), tw, rowwise).plan(ebc)  # one float per row
    with pytest.raises(ValueError, match="table 't'.*fits on no rank"):
        EmbeddingShardingPlanner(Topology(1, ddr_cap=weights + 100 * 4 - 1), tw, rowwise).plan(ebc)
    with pytest.raises(ValueError, match="table 't'"):
        EmbeddingShardingPlanner(Topology(1, ddr_cap=2 * weights - 1), tw, adagrad).plan(ebc)
    # row-wise over 2 ranks halves what each holds, so it fits where table-wise cannot
    plan = EmbeddingShardingPlanner(Topology(2, ddr_cap=weights // 2 + 50 * 4), optimizer=rowwise).plan(ebc)
    assert plan.get_plan_for_module("")["t"].sharding_type != ShardingType.TABLE_WISE


def test_bad_constraints_name_the_table():
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="odd", num_embeddings=10, embedding_dim=6)], device="meta")
    with pytest.raises(ValueError, match="'odd'.*divisible by 4"):
        EmbeddingShardingPlanner(Topology(2), forced(ShardingType.COLUMN_WISE, ["odd"])).plan(ebc)
    with pytest.raises(ValueError, match="'nope'"):
        EmbeddingShardingPlanner(Topology(2), forced(ShardingType.ROW_WISE, ["nope"])).plan(ebc)
    with pytest.raises(ValueError, match="'odd'.*no sharding type"):
        EmbeddingShardingPlanner(Topology(2), {"odd": ParameterConstraints(sharding_types=[])}).plan(ebc)


def test_collective_plan_without_process_group_equals_plan():
    ebc = tutorial_ebc()
    planner = EmbeddingShardingPlanner(Topology(2))
    assert planner.collective_plan(ebc) == planner.plan(ebc)
