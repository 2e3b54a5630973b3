"""EmbeddingShardingPlanner: shard geometry, memory accounting, cost-driven placement, errors."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gloo_ranks import one_rank_group
from recship.names import TRAINING_SHARDING_TYPES
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.planner import (
    EmbeddingComputeKernel,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingPlan,
    ShardingType,
    Topology,
    column_block_count,
    column_blocks,
    row_blocks,
    shard_bytes,
    shard_cost,
)

TUTORIAL = {"large_0": 4096, "large_1": 4096, "small_0": 1024, "small_1": 1024}
SGD = FusedOptimizerConfig(EmbOptimType.EXACT_SGD)
ADAGRAD = FusedOptimizerConfig(EmbOptimType.EXACT_ADAGRAD)
ROWWISE = FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD)


def ebc_of(tables, dim=64):
    """A meta-device EBC with tables {name: rows}, all ``dim`` wide."""
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=dim) for n, r in tables.items()], device="meta"
    )


def forced(st, names=TUTORIAL):
    return {n: ParameterConstraints(sharding_types=[st]) for n in names}


def check_plan(plan, module, world_size):
    """Every table's shards tile it exactly (cell by cell) and agree with ranks and kernel."""
    for path, sub in module.named_modules():
        if not isinstance(sub, EmbeddingBagCollection):
            continue
        for t in sub.embedding_bag_configs():
            ps = plan.get_plan_for_module(path)[t.name]
            assert ps.ranks == [s.rank for s in ps.shards]
            assert all(0 <= r < world_size for r in ps.ranks)
            dp = ps.sharding_type == ShardingType.DATA_PARALLEL
            assert ps.compute_kernel == (EmbeddingComputeKernel.DENSE if dp else EmbeddingComputeKernel.FUSED)
            if dp:
                assert ps.ranks == list(range(world_size))
                assert all(s.shard_offsets == [0, 0] and s.shard_sizes == [t.num_embeddings, t.embedding_dim]
                           for s in ps.shards)
                continue
            assert len(set(ps.ranks)) == len(ps.ranks), f"{t.name}: two shards on one rank"
            cover = torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.int64)
            for s in ps.shards:
                (r, c), (n, w) = s.shard_offsets, s.shard_sizes
                assert n > 0 and w > 0 and r + n <= t.num_embeddings and c + w <= t.embedding_dim
                cover[r : r + n, c : c + w] += 1
            assert bool((cover == 1).all()), f"{t.name}: shards overlap or leave a gap"


def geometry(plan, name, path=""):
    return [(s.rank, s.shard_offsets, s.shard_sizes) for s in plan.get_plan_for_module(path)[name].shards]


# -- pure geometry functions -------------------------------------------------


@pytest.mark.parametrize(
    "rows, ranks, expect",
    [
        (4096, [0, 1], [(0, 0, 2048), (1, 2048, 2048)]),
        (10, [0, 1, 2], [(0, 0, 4), (1, 4, 4), (2, 8, 2)]),
        (2, [0, 1, 2], [(0, 0, 1), (1, 1, 1)]),
        (5, [0, 1, 2, 3], [(0, 0, 2), (1, 2, 2), (2, 4, 1)]),  # rank 3's block would be empty
        (7, [2, 3], [(2, 0, 4), (3, 4, 3)]),
    ],
)
def test_row_blocks_examples(rows, ranks, expect):
    assert row_blocks(rows, ranks) == expect


def test_row_blocks_are_ceil_sized_and_contiguous():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows, n = int(torch.randint(1, 50, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        blocks = row_blocks(rows, list(range(n)))
        block = -(-rows // n)
        assert [b[0] for b in blocks] == list(range(len(blocks)))
        assert [b[1] for b in blocks] == [i * block for i in range(len(blocks))]
        assert all(b[2] == block for b in blocks[:-1]) and 1 <= blocks[-1][2] <= block
        assert sum(b[2] for b in blocks) == rows


@pytest.mark.parametrize(
    "dim, n, widths",
    [(64, 2, [32, 32]), (64, 3, [24, 20, 20]), (12, 3, [4, 4, 4]), (40, 3, [16, 12, 12]), (8, 1, [8])],
)
def test_column_blocks_examples(dim, n, widths):
    blocks = column_blocks(dim, n)
    assert [w for _, w in blocks] == widths
    assert [o for o, _ in blocks] == [sum(widths[:i]) for i in range(n)]


def test_column_blocks_rejects_impossible_splits():
    with pytest.raises(ValueError, match="divisible by 4"):
        column_blocks(6, 1)
    with pytest.raises(ValueError, match="8 columns into 3"):
        column_blocks(8, 3)


@pytest.mark.parametrize(
    "dim, world, min_partition, n",
    [(64, 2, None, 2), (8, 4, None, 2), (64, 4, 32, 2), (64, 4, 100, 1), (64, 8, 16, 4)],
)
def test_column_block_count(dim, world, min_partition, n):
    assert column_block_count(dim, world, min_partition) == n


def test_shard_bytes_and_cost_by_hand():
    assert shard_bytes(100, 8, ShardingType.ROW_WISE, EmbOptimType.EXACT_SGD) == 3200
    assert shard_bytes(100, 8, ShardingType.ROW_WISE, EmbOptimType.EXACT_ROWWISE_ADAGRAD) == 3200 + 400
    assert shard_bytes(100, 8, ShardingType.TABLE_WISE, EmbOptimType.EXACT_ADAGRAD) == 6400
    assert shard_bytes(100, 8, ShardingType.DATA_PARALLEL, EmbOptimType.EXACT_SGD) == 9600
    # global batch 1024 ids, half of them in this shard, 64 columns each, plus a [1024, 64] output sent back
    assert shard_cost(2048, 64, 4096, ShardingType.ROW_WISE, 512, 2, 1.0, 1) == 512 * 64 + 1024 * 64
    # data-parallel: local batch of 512 x 2 ids x 4 columns, plus 2 x the 10 x 4 gradient
    assert shard_cost(10, 4, 10, ShardingType.DATA_PARALLEL, 512, 2, 2.0, 1) == 512 * 2 * 4 + 80


# -- the tutorial's four tables ----------------------------------------------


def test_tutorial_row_wise_gives_2048_rows_per_rank():
    ebc = ebc_of(TUTORIAL)
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(ShardingType.ROW_WISE)).plan(ebc)
    check_plan(plan, ebc, 2)
    for name in ("large_0", "large_1"):
        assert geometry(plan, name) == [(0, [0, 0], [2048, 64]), (1, [2048, 0], [2048, 64])]
    assert geometry(plan, "small_0") == [(0, [0, 0], [512, 64]), (1, [512, 0], [512, 64])]


def test_sharding_type_and_compute_kernel_compare_equal_to_their_strings():
    """TorchRec's ParameterSharding holds strings: code written for it compares with ``ShardingType.X.value`` or a
    literal, and must not be silently False here."""
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(ShardingType.ROW_WISE)).plan(ebc_of(TUTORIAL))
    for module_plan in plan.plan.values():
        for p in module_plan.values():
            assert p.sharding_type == ShardingType.ROW_WISE.value == "row_wise" and p.sharding_type != "table_wise"
            assert p.compute_kernel == "fused" and {p.sharding_type: 1}["row_wise"] == 1
    assert ShardingType("column_wise") is ShardingType.COLUMN_WISE and isinstance(ShardingType.COLUMN_WISE, str)


def test_tutorial_column_wise_gives_32_columns_per_rank():
    ebc = ebc_of(TUTORIAL)
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(ShardingType.COLUMN_WISE)).plan(ebc)
    check_plan(plan, ebc, 2)
    for name, rows in TUTORIAL.items():
        shards = sorted(geometry(plan, name))
        assert [(r, s) for r, _, s in shards] == [(0, [rows, 32]), (1, [rows, 32])]
        assert sorted(o for _, o, _ in shards) == [[0, 0], [0, 32]]


def test_column_wise_over_3_ranks_uses_blocks_of_24_20_20_on_distinct_ranks():
    ebc = ebc_of({"t": 100})
    plan = EmbeddingShardingPlanner(Topology(3, "cpu"), constraints=forced(ShardingType.COLUMN_WISE, ["t"])).plan(ebc)
    check_plan(plan, ebc, 3)
    shards = geometry(plan, "t")
    assert [(o, s) for _, o, s in shards] == [([0, 0], [100, 24]), ([0, 24], [100, 20]), ([0, 44], [100, 20])]
    assert sorted(r for r, _, _ in shards) == [0, 1, 2]


def test_tutorial_table_wise_balances_one_large_and_one_small_per_rank():
    ebc = ebc_of(TUTORIAL)
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(ShardingType.TABLE_WISE)).plan(ebc)
    check_plan(plan, ebc, 2)
    by_rank = {0: [], 1: []}
    for name, rows in TUTORIAL.items():
        [(rank, offsets, sizes)] = geometry(plan, name)
        assert (offsets, sizes) == ([0, 0], [rows, 64])
        by_rank[rank].append(name.split("_")[0])
    assert sorted(by_rank[0]) == sorted(by_rank[1]) == ["large", "small"]


def test_table_row_wise_splits_rows_inside_one_host():
    ebc = ebc_of(TUTORIAL)
    plan = EmbeddingShardingPlanner(Topology(4, "cpu", local_world_size=2), constraints=forced(ShardingType.TABLE_ROW_WISE)).plan(ebc)
    check_plan(plan, ebc, 4)
    hosts = []
    for name, rows in TUTORIAL.items():
        shards = geometry(plan, name)
        ranks = [r for r, _, _ in shards]
        assert ranks in ([0, 1], [2, 3]), f"{name} is not on one host: {ranks}"
        assert [(o, s) for _, o, s in shards] == [([0, 0], [rows // 2, 64]), ([rows // 2, 0], [rows // 2, 64])]
        hosts.append(ranks[0] // 2)
    assert sorted(hosts) == [0, 0, 1, 1]  # one large and one small table per host


def test_data_parallel_replicates_on_every_rank():
    ebc = ebc_of(TUTORIAL)
    plan = EmbeddingShardingPlanner(Topology(3, "cpu"), constraints=forced(ShardingType.DATA_PARALLEL)).plan(ebc)
    check_plan(plan, ebc, 3)
    for name, rows in TUTORIAL.items():
        assert geometry(plan, name) == [(r, [0, 0], [rows, 64]) for r in range(3)]
        assert plan.get_plan_for_module("")[name].compute_kernel == EmbeddingComputeKernel.DENSE


@pytest.mark.parametrize("rows, sizes", [(10, [4, 4, 2]), (2, [1, 1]), (9, [3, 3, 3]), (7, [3, 3, 1])])
def test_uneven_row_splits_for_world_size_3(rows, sizes):
    ebc = ebc_of({"t": rows}, dim=8)
    plan = EmbeddingShardingPlanner(Topology(3, "cpu"), constraints=forced(ShardingType.ROW_WISE, ["t"])).plan(ebc)
    check_plan(plan, ebc, 3)
    assert [(r, s[0]) for r, _, s in geometry(plan, "t")] == list(enumerate(sizes))
    assert plan.get_plan_for_module("")["t"].ranks == list(range(len(sizes)))


@pytest.mark.parametrize("topology", [Topology(1, "cpu"), Topology(2, "cpu"), Topology(3, "cpu"), Topology(4, "cpu", local_world_size=2)])
def test_default_plans_tile_every_table_and_are_deterministic(topology):
    ebc = ebc_of({"a": 4096, "b": 1000, "c": 7, "d": 1024})
    planner = EmbeddingShardingPlanner(topology)
    plan = planner.plan(ebc)
    check_plan(plan, ebc, topology.world_size)
    assert all(ps.sharding_type != ShardingType.DATA_PARALLEL for ps in plan.get_plan_for_module("").values())
    assert planner.plan(ebc).to_json() == plan.to_json()


# -- cost ----------------------------------------------------------------------


def test_pooling_factor_moves_a_busy_table_to_a_rank_of_its_own():
    ebc = ebc_of({"busy": 100, "a": 100, "b": 100, "c": 100}, dim=8)
    constraints = forced(ShardingType.TABLE_WISE, ["busy", "a", "b", "c"])
    constraints["busy"].pooling_factor = 10.0
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=constraints).plan(ebc).get_plan_for_module("")
    busy_rank = plan["busy"].ranks[0]
    assert [n for n, ps in plan.items() if ps.ranks[0] == busy_rank] == ["busy"]


@pytest.mark.parametrize("rows, winner", [(10, ShardingType.DATA_PARALLEL), (100_000, ShardingType.TABLE_WISE)])
def test_data_parallel_wins_for_a_tiny_table_only(rows, winner):
    # table-wise on one rank: 1024 ids x 8 columns looked up + a [1024, 8] output sent = 16384 floats;
    # data-parallel on each rank: 512 ids x 8 columns + all-reducing 2 x rows x 8 gradient floats
    ebc = ebc_of({"t": rows}, dim=8)
    both = ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL])
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"t": both}).plan(ebc)
    check_plan(plan, ebc, 2)
    assert plan.get_plan_for_module("")["t"].sharding_type == winner


# -- memory --------------------------------------------------------------------


def test_memory_counts_optimizer_state():
    ebc = ebc_of({"t": 100}, dim=8)
    weights = 100 * 8 * 4
    tw = forced(ShardingType.TABLE_WISE, ["t"])
    EmbeddingShardingPlanner(Topology(1, "cpu", ddr_cap=weights), constraints=tw, optimizer=SGD).plan(ebc)  # SGD keeps no state
    with pytest.raises(ValueError, match=f"table 't' \\({2 * weights} bytes.*capacity {2 * weights - 1} bytes"):
        EmbeddingShardingPlanner(Topology(1, "cpu", ddr_cap=2 * weights - 1), constraints=tw, optimizer=ADAGRAD).plan(ebc)
    EmbeddingShardingPlanner(Topology(1, "cpu", ddr_cap=2 * weights), constraints=tw, optimizer=ADAGRAD).plan(ebc)
    EmbeddingShardingPlanner(Topology(1, "cpu", ddr_cap=weights + 100 * 4), constraints=tw, optimizer=ROWWISE).plan(ebc)  # one float per row
    with pytest.raises(ValueError, match="table 't'.*fits on no rank"):
        EmbeddingShardingPlanner(Topology(1, "cpu", ddr_cap=weights + 100 * 4 - 1), constraints=tw, optimizer=ROWWISE).plan(ebc)
    assert EmbeddingShardingPlanner(Topology(1, "cpu", ddr_cap=weights + 100 * 4)).optimizer == ROWWISE  # the default


def test_data_parallel_counts_weights_gradient_and_state_on_every_rank():
    ebc = ebc_of({"t": 100}, dim=8)
    dp = forced(ShardingType.DATA_PARALLEL, ["t"])
    EmbeddingShardingPlanner(Topology(2, "cpu", ddr_cap=3 * 3200), constraints=dp, optimizer=SGD).plan(ebc)
    with pytest.raises(ValueError, match=f"table 't' \\({3 * 3200} bytes.*capacity {3 * 3200 - 1} bytes"):
        EmbeddingShardingPlanner(Topology(2, "cpu", ddr_cap=3 * 3200 - 1), constraints=dp, optimizer=SGD).plan(ebc)


def test_memory_adds_up_across_tables():
    ebc = ebc_of({"a": 100, "b": 100, "c": 100}, dim=8)
    tw = forced(ShardingType.TABLE_WISE, ["a", "b", "c"])
    plan = EmbeddingShardingPlanner(Topology(3, "cpu", ddr_cap=3200), constraints=tw, optimizer=SGD).plan(ebc).get_plan_for_module("")
    assert sorted(ps.ranks[0] for ps in plan.values()) == [0, 1, 2]  # one table fills a rank
    with pytest.raises(ValueError, match="table 'c'.*already used"):
        EmbeddingShardingPlanner(Topology(2, "cpu", ddr_cap=3200), constraints=tw, optimizer=SGD).plan(ebc)


def test_memory_pushes_a_table_to_row_wise():
    ebc = ebc_of({"t": 100}, dim=8)
    # row-wise: 50 x 8 weights + 50 row states = 1800 bytes per rank; column-wise needs 100 x 4 + 100 = 2000
    plan = EmbeddingShardingPlanner(Topology(2, "cpu", ddr_cap=1800), optimizer=ROWWISE).plan(ebc)
    check_plan(plan, ebc, 2)
    assert plan.get_plan_for_module("")["t"].sharding_type == ShardingType.ROW_WISE


# -- several collections ---------------------------------------------------------


def test_plans_every_collection_by_path():
    model = nn.Module()
    model.a = ebc_of({"t": 100, "u": 20}, dim=8)
    model.b = nn.Module()
    model.b.c = ebc_of({"t": 100}, dim=8)
    # each rank holds one 100 x 8 table: the two tables named "t" must land on different ranks
    plan = EmbeddingShardingPlanner(Topology(2, "cpu", ddr_cap=3200 + 640), constraints=forced(ShardingType.TABLE_WISE, ["t", "u"]),
                                    optimizer=SGD).plan(model)
    check_plan(plan, model, 2)
    assert list(plan.plan) == ["a", "b.c"]
    assert {geometry(plan, "t", "a")[0][0], geometry(plan, "t", "b.c")[0][0]} == {0, 1}
    assert EmbeddingShardingPlanner(Topology(1, "cpu")).plan(nn.Linear(2, 2)) == ShardingPlan({})


# -- errors ----------------------------------------------------------------------


def test_bad_constraints_name_the_table():
    ebc = ebc_of({"odd": 10}, dim=6)
    with pytest.raises(ValueError, match="'odd'.*divisible by 4"):
        EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(ShardingType.COLUMN_WISE, ["odd"])).plan(ebc)
    with pytest.raises(ValueError, match="'nope'"):
        EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(ShardingType.ROW_WISE, ["nope"])).plan(ebc)
    with pytest.raises(ValueError, match="'odd'.*no sharding type"):
        EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"odd": ParameterConstraints(sharding_types=[])}).plan(ebc)
    dense_row_wise = ParameterConstraints([ShardingType.ROW_WISE], [EmbeddingComputeKernel.DENSE])
    with pytest.raises(ValueError, match="'odd'.*compute kernels \\['dense'\\]"):
        EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"odd": dense_row_wise}).plan(ebc)


def test_constraints_take_the_enum_values_as_strings_as_torchrec_tutorials_write_them():
    ebc = ebc_of({"a": 40, "b": 20})
    for st in TRAINING_SHARDING_TYPES:
        by_enum = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(st, ["a", "b"])).plan(ebc)
        by_value = {t: ParameterConstraints(sharding_types=[st.value]) for t in ["a", "b"]}
        assert EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=by_value).plan(ebc) == by_enum
    kernels = ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["dense"])
    assert kernels.compute_kernels == [EmbeddingComputeKernel.DENSE]
    with pytest.raises(ValueError, match="unknown sharding type 'tablewise'.*'table_wise'"):
        ParameterConstraints(sharding_types=["tablewise"])
    with pytest.raises(ValueError, match="compute kernel 'fused_uvm' is TorchRec's.*'fused'"):
        ParameterConstraints(compute_kernels=["fused_uvm"])
    with pytest.raises(ValueError, match="unknown sharding type 3"):
        ParameterConstraints(sharding_types=[3])


def test_column_wise_is_skipped_for_an_odd_dim_when_other_types_are_allowed():
    ebc = ebc_of({"odd": 10}, dim=6)
    types = [ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE]
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"odd": ParameterConstraints(types)}).plan(ebc)
    assert plan.get_plan_for_module("")["odd"].sharding_type == ShardingType.TABLE_WISE


# -- JSON, printing, collective ---------------------------------------------------


def test_json_round_trip_and_printed_table(tmp_path):
    ebc = ebc_of(TUTORIAL)
    plan = EmbeddingShardingPlanner(Topology(3, "cpu")).plan(ebc)
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == plan
    assert ShardingPlan.from_json(plan.to_json()).to_json() == plan.to_json()

    # TorchRec's layout: "module: <path>", then a table of shardings and one of shards
    lines = [re.sub(r" +", " ", line).strip() for line in str(plan).splitlines()]
    assert lines[0] == "module:"
    assert "param | sharding type | compute kernel | ranks" in lines
    assert "param | shard offsets | shard sizes | placement" in lines
    for name, ps in plan.get_plan_for_module("").items():
        assert f"{name} | {ps.sharding_type.value} | {ps.compute_kernel.value} | {ps.ranks}" in lines
    shards = [(n, s) for n, ps in plan.get_plan_for_module("").items() for s in ps.shards]
    assert len([line for line in lines if "rank:" in line]) == len(shards)
    for name, s in shards:
        assert f"{name} | {s.shard_offsets} | {s.shard_sizes} | rank:{s.rank}/cpu" in lines
    cuda = EmbeddingShardingPlanner(Topology(4, "cuda", local_world_size=2)).plan(ebc)
    assert {s.placement for ps in cuda.plan[""].values() for s in ps.shards} <= {f"rank:{r}/cuda:{r % 2}" for r in range(4)}


def test_collective_plan_without_process_group_equals_plan():
    ebc = ebc_of(TUTORIAL)
    planner = EmbeddingShardingPlanner(Topology(2, "cpu"))
    assert not dist.is_initialized()
    assert planner.collective_plan(ebc) == planner.plan(ebc)


def test_collective_plan_on_a_one_rank_group_broadcasts_plan_and_errors(tmp_path):
    ebc = ebc_of(TUTORIAL)
    with one_rank_group(tmp_path):
        planner = EmbeddingShardingPlanner(Topology(2, "cpu"))
        assert planner.collective_plan(ebc) == planner.plan(ebc)
        with pytest.raises(ValueError, match="'nope'"):
            EmbeddingShardingPlanner(Topology(2, "cpu"), constraints=forced(ShardingType.ROW_WISE, ["nope"])).collective_plan(ebc)


# -- lookups over shards ------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
def test_bucketize_rows_keeps_the_blocks_ids_rebased(weighted):
    from recship.trainer.planner.planner import bucketize_rows

    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 6, (9,), generator=g)
    ids = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    weights = torch.rand(ids.numel(), generator=g) if weighted else None
    for r, offset, rows in row_blocks(30, [0, 1, 2, 3]):
        got_ids, got_lengths, got_weights = bucketize_rows(ids, lengths, weights, offset, rows)
        want_ids, want_lengths, want_weights, start = [], [], [], 0
        for n in lengths.tolist():  # plain Python, example by example
            bag = [(i, k) for k, i in enumerate(ids.tolist()[start : start + n], start) if offset <= i < offset + rows]
            want_ids += [i - offset for i, _ in bag]
            want_weights += [float(weights[k]) for _, k in bag] if weighted else []
            want_lengths.append(len(bag))
            start += n
        assert got_ids.tolist() == want_ids, r
        assert got_lengths.tolist() == want_lengths
        assert got_weights is None if not weighted else got_weights.tolist() == pytest.approx(want_weights)


def test_merge_blocks_adds_row_partials_and_concatenates_columns_by_offset():
    from recship.trainer.planner.planner import merge_blocks

    g = torch.Generator().manual_seed(1)
    a0, a1, b0, b1 = (torch.randn(5, w, generator=g) for w in (8, 8, 4, 4))
    # column block at offset 8 listed first; two row partials for each column block
    got = merge_blocks([(8, b0), (0, a0), (8, b1), (0, a1)])
    torch.testing.assert_close(got, torch.cat([a0 + a1, b0 + b1], dim=1), rtol=0, atol=0)
    assert merge_blocks([(0, a0)]) is a0
