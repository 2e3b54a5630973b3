"""TorchRec's sharding API through the import map (``torchrec.distributed.*`` -> ``recship.distributed``): the
``sharding_plan`` helpers' parameters and return type, ``ParameterConstraints`` / ``ParameterSharding`` fields (each
honoured or refused naming why), the enum members TorchRec has, the planner's parts, ``shard_modules`` and
DistributedModelParallel's ``init_data_parallel`` / ``init_parameters`` / ``data_parallel_wrapper``.

Facts marked "TorchRec 1.8.0" were recorded by running TorchRec 1.8.0 (CPU, the same torch and fbgemm) on the same
inputs; the numbers elsewhere are worked out in the tests from the rules they check.
"""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gloo_ranks import run_ranks
from recship.distributed import (DataParallelWrapper, DefaultDataParallelWrapper, DistributedModelParallel,
                                 DynamicProgrammingProposer, EmbeddingBagCollectionSharder, EmbeddingCollectionSharder,
                                 EmbeddingComputeKernel, EmbeddingEnumerator, EmbeddingModuleShardingPlan, Enumerator,
                                 EmbeddingOffloadScaleupProposer, EmbeddingPerfEstimator, EmbeddingShardingPlanner,
                                 EmbeddingStorageEstimator, GreedyPerfPartitioner, HeuristicalStorageReservation,
                                 ParameterConstraints, ParameterSharding, PlannerError, PlannerErrorType, ShardingEnv,
                                 ShardingPlan, ShardingPlanner, ShardingType, ShardMetadata, SortBy, Topology, column_wise,
                                 construct_module_sharding_plan, data_parallel, grid_shard, row_wise, shard_modules,
                                 table_row_wise, table_wise)
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from recship.trainer.planner.planner import _load

LOCAL_BATCH, LR, DIM = 3, 0.1, 4


def _ebc(device: str = "meta") -> EmbeddingBagCollection:
    """TorchRec 1.8.0's facts below are for these two tables."""
    return EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=100, feature_names=["f"]),
                                   EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=50, feature_names=["g"])],
                                  device=torch.device(device))


def _geometry(ps: ParameterSharding):
    shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []
    return (ps.sharding_type.value, ps.compute_kernel.value, ps.ranks,
            [(list(s.shard_offsets), list(s.shard_sizes), str(s.placement)) for s in shards])


# -- sharding_plan helpers ----------------------------------------------------------------------------------------


def test_helpers_return_torchrecs_plan_type_and_geometry():
    ebc = _ebc()
    plan = construct_module_sharding_plan(ebc, {"t": table_wise(rank=1), "u": row_wise()}, local_size=2, world_size=2,
                                          device_type="cpu")
    assert isinstance(plan, EmbeddingModuleShardingPlan) and isinstance(plan, dict)
    # TorchRec 1.8.0: the same shards (its kernel is dense here, recship's fused: docs/torchrec.md, "Plans by hand")
    kind, _, ranks, shards = _geometry(plan["t"])
    assert (kind, ranks, shards) == ("table_wise", [1], [([0, 0], [100, 16], "rank:1/cpu")])
    assert _geometry(plan["u"])[3] == [([0, 0], [25, 8], "rank:0/cpu"), ([25, 0], [25, 8], "rank:1/cpu")]
    assert plan["t"].compute_kernel == EmbeddingComputeKernel.FUSED
    plan = construct_module_sharding_plan(ebc, {"t": column_wise(ranks=[0, 1]), "u": data_parallel()}, local_size=2,
                                          world_size=2, device_type="cpu")
    assert _geometry(plan["t"])[3] == [([0, 0], [100, 8], "rank:0/cpu"), ([0, 8], [100, 8], "rank:1/cpu")]
    assert _geometry(plan["u"]) == ("data_parallel", "dense", [0, 1], [])
    # TorchRec 1.8.0: size_per_rank puts block i on rank i; a given kernel is kept
    plan = construct_module_sharding_plan(ebc, {"t": column_wise(size_per_rank=[12, 4], compute_kernel="fused"),
                                                "u": table_row_wise(host_index=0)}, local_size=2, world_size=2,
                                          device_type="cpu")
    assert _geometry(plan["t"]) == ("column_wise", "fused", [0, 1],
                                    [([0, 0], [100, 12], "rank:0/cpu"), ([0, 12], [100, 4], "rank:1/cpu")])
    assert _geometry(plan["u"])[3] == [([0, 0], [25, 8], "rank:0/cpu"), ([25, 0], [25, 8], "rank:1/cpu")]
    # TorchRec 1.8.0's printout of that plan, line for line (its kernel for "u" is dense)
    assert str(plan).splitlines() == [
        "param | sharding type  | compute kernel | ranks ", "----- | -------------- | -------------- | ------",
        "t     | column_wise    | fused          | [0, 1]", "u     | table_row_wise | fused          | [0, 1]", "",
        "param | shard offsets | shard sizes | placement ", "----- | ------------- | ----------- | ----------",
        "t     | [0, 0]        | [100, 12]   | rank:0/cpu", "t     | [0, 12]       | [100, 4]    | rank:1/cpu",
        "u     | [0, 0]        | [25, 8]     | rank:0/cpu", "u     | [25, 0]       | [25, 8]     | rank:1/cpu"]


def test_helpers_take_torchrecs_kernel_argument_and_refuse_what_recship_cannot_run():
    ebc = _ebc()
    dense_tw = construct_module_sharding_plan(ebc, {"t": table_wise(rank=0, compute_kernel="dense"), "u": data_parallel()},
                                              world_size=2, device_type="cpu")
    assert dense_tw["t"].compute_kernel == EmbeddingComputeKernel.DENSE  # written as asked; DMP refuses it (below)
    uneven = construct_module_sharding_plan(ebc, {"t": row_wise(([60, 40], "cpu")), "u": data_parallel()}, world_size=2,
                                            device_type="cpu")
    assert uneven["t"].compute_kernel == EmbeddingComputeKernel.QUANT  # TorchRec: sizes_placement means inference
    with pytest.raises(ValueError, match="compute kernel 'fused_uvm_caching' is TorchRec's"):
        table_wise(rank=0, compute_kernel="fused_uvm_caching")
    with pytest.raises(ValueError, match="num_buckets"):
        row_wise(num_buckets=4)
    with pytest.raises(ValueError, match="device_types"):
        column_wise(ranks=[0, 1], device_types=["cpu", "cuda"])
    with pytest.raises(ValueError, match="either ranks= .* or size_per_rank="):
        column_wise()
    with pytest.raises(ValueError, match=r"size_per_rank=\[10, 6\].*multiples of 4"):
        construct_module_sharding_plan(ebc, {"t": column_wise(size_per_rank=[10, 6]), "u": data_parallel()}, world_size=2)
    with pytest.raises(ValueError, match="sharding type 'grid_shard' is TorchRec's"):
        grid_shard(host_indexes=[0])
    with pytest.raises(TypeError, match="shards EmbeddingCollection, not EmbeddingBagCollection"):
        construct_module_sharding_plan(ebc, {"t": data_parallel(), "u": data_parallel()}, EmbeddingCollectionSharder())


# -- enums, ParameterSharding, ParameterConstraints --------------------------------------------------------------


def test_torchrecs_enum_members_exist_and_choosing_one_recship_cannot_run_names_it():
    assert [m.value for m in ShardingType][-2:] == ["table_column_wise", "grid_shard"]
    assert {"fused_uvm", "quant", "key_value", "ssd_virtual_table", "fused_triton"} <= {m.value for m in EmbeddingComputeKernel}
    assert PlannerErrorType.INVALID_COMPUTE_KERNEL.value == "invalid_compute_kernel"
    for st in ("table_column_wise", ShardingType.GRID_SHARD):
        with pytest.raises(ValueError, match=f"sharding type '{ShardingType(st).value}' is TorchRec's"):
            ParameterConstraints(sharding_types=[st])
        with pytest.raises(ValueError, match=f"sharding type '{ShardingType(st).value}' is TorchRec's"):
            ParameterSharding(st, "fused", [0])
    with pytest.raises(ValueError, match="compute kernel 'key_value' is TorchRec's"):
        ParameterConstraints(compute_kernels=[EmbeddingComputeKernel.KEY_VALUE])
    assert EmbeddingBagCollectionSharder().sharding_types("cpu") == [
        "data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise"]


def test_parameter_sharding_takes_torchrecs_fields():
    shards = [ShardMetadata([0, 0], [5, 8], 0), ShardMetadata([5, 0], [5, 8], 1)]
    ps = ParameterSharding("row_wise", "fused", [0, 1], shards, stochastic_rounding=True, bounds_check_mode="FATAL",
                           output_dtype="FP32")
    assert ps.sharding_type is ShardingType.ROW_WISE and ps.compute_kernel is EmbeddingComputeKernel.FUSED
    spec = ps.sharding_spec
    assert [str(m.placement) for m in spec.shards] == ["rank:0/cpu", "rank:1/cpu"]
    assert ParameterSharding("row_wise", "fused", [0, 1], sharding_spec=spec).shards == shards  # TorchRec's keyword
    assert ParameterSharding("row_wise", "fused", [0, 1], spec).shards == shards  # and its 4th positional field
    back = ShardingPlan.from_json(ShardingPlan({"": {"t": ps}}).to_json()).plan[""]["t"]
    assert back == ps and back.stochastic_rounding is True and back.bounds_check_mode == "FATAL"
    with pytest.raises(ValueError, match="describe different shards"):
        ParameterSharding("row_wise", "fused", [0, 1], shards[:1], sharding_spec=spec)
    refused = {"cache_params": (object(), "UVM cache.*CUDA-only"), "enforce_hbm": (True, "CUDA-only"),
               "key_value_params": (object(), "key-value"), "bounds_check_mode": ("WARNING", "FATAL"),
               "output_dtype": ("FP16", "return fp32")}
    for name, (value, why) in refused.items():
        with pytest.raises(ValueError, match=why):
            ParameterSharding("table_wise", "fused", [0], **{name: value})


def test_parameter_constraints_fields_are_used_or_refused():
    refused = {"cache_params": (object(), "UVM cache"), "enforce_hbm": (True, "CUDA-only"),
               "key_value_params": (object(), "key-value"), "bounds_check_mode": ("IGNORE", "FATAL"),
               "output_dtype": ("BF16", "return fp32"), "use_virtual_table": (True, "virtual tables"),
               "device_group": ("mtia", "device_group")}
    for name, (value, why) in refused.items():
        with pytest.raises(ValueError, match=why):
            ParameterConstraints(**{name: value})
    with pytest.raises(ValueError, match="lengths .* differ"):
        ParameterConstraints(pooling_factors=[1.0, 2.0], batch_sizes=[8])
    with pytest.raises(ValueError, match="positive"):
        ParameterConstraints(pooling_factors=[0.0])
    ebc = _ebc()
    for c, why in ((ParameterConstraints(pooling_factors=[1.0, 2.0]), "2 entries, the table has 1"),
                   (ParameterConstraints(feature_names=["nope"]), "not the table's features"),
                   (ParameterConstraints(device_group="cuda"), "device_group 'cuda'")):
        with pytest.raises(PlannerError, match=f"'t'.*{why}") as e:
            EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"t": c}).plan(ebc)
        assert e.value.error_type is PlannerErrorType.STRICT_CONSTRAINTS
    # copied into the plan, as TorchRec copies them
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"t": ParameterConstraints(
        stochastic_rounding=False, bounds_check_mode="FATAL", output_dtype="FP32")}).plan(ebc).plan[""]
    assert (plan["t"].stochastic_rounding, plan["t"].bounds_check_mode, plan["t"].output_dtype) == (False, "FATAL", "FP32")
    assert isinstance(plan, EmbeddingModuleShardingPlan)


def test_dense_kernel_alone_plans_the_table_data_parallel():
    """TorchRec 1.8.0 (2 CPU ranks): ParameterConstraints(compute_kernels=["dense"]) -> t data_parallel, dense."""
    plan = EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"t": ParameterConstraints(compute_kernels=["dense"])}).plan(_ebc())
    assert _geometry(plan.plan[""]["t"]) == ("data_parallel", "dense", [0, 1], [])
    with pytest.raises(PlannerError, match="compute kernels \\['dense'\\] fit none"):  # asked for a sharded type too
        EmbeddingShardingPlanner(Topology(2, "cpu"), constraints={"t": ParameterConstraints(
            sharding_types=["row_wise"], compute_kernels=["dense"])}).plan(_ebc())


def test_per_feature_loads_drive_the_cost_and_the_reservation():
    """pooling_factors / num_poolings / batch_sizes per feature: the same plan as recship's pooling_factor where they
    say the same, and the storage reservation counts ids x (8 bytes, + 4 for a weight) x 20 copies."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"a{i}", f"b{i}"])
              for i, rows in enumerate([40, 64, 24, 80])]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    one = {t.name: ParameterConstraints(pooling_factor=3.0 + i) for i, t in enumerate(tables)}
    per_feature = {t.name: ParameterConstraints(pooling_factors=[3.0 + i] * 2, feature_names=t.feature_names)
                   for i, t in enumerate(tables)}
    plans = [EmbeddingShardingPlanner(Topology(4, "cpu"), batch_size=32, constraints=c).plan(ebc) for c in (one, per_feature)]
    assert plans[0] == plans[1]
    heavy = {"t0": ParameterConstraints(pooling_factors=[500.0, 500.0])}
    assert EmbeddingShardingPlanner(Topology(4, "cpu"), batch_size=32, constraints=heavy).plan(ebc) != plans[0]
    # feature a: 10 examples x 1.0 ids x 2 poolings, b: 20 x 3.0 x 1 -> 80 ids and 40 pooled outputs a step
    c = ParameterConstraints(pooling_factors=[1.0, 3.0], num_poolings=[2.0, 1.0], batch_sizes=[10, 20])
    assert _load(c, tables[0], 10) == (80 / 40, 40 / 10)
    assert _load(ParameterConstraints(pooling_factor=2.5), tables[0], 10) == (2.5, 2)

    def reserved(constraints):
        r = HeuristicalStorageReservation(percentage=0.0, dense_tensor_estimate=0)
        EmbeddingShardingPlanner(Topology(2, "cpu", ddr_cap=10**9), batch_size=10, storage_reservation=r,
                                 constraints=constraints).plan(ebc)
        return r.last_reserved["kjt"]

    assert reserved({}) == 4 * 10 * 1.0 * 8 * 20  # four tables, TorchRec's default of one pooling factor each
    assert reserved({"t0": ParameterConstraints(pooling_factors=[2.0, 3.0], batch_sizes=[10, 4])}) == (
        3 * 10 * 8 + (2.0 * 10 + 3.0 * 4) * 8) * 20
    assert reserved({"t0": ParameterConstraints(is_weighted=True)}) == (3 * 10 * 8 + 10 * 12) * 20


# -- the planner's parts -----------------------------------------------------------------------------------------


def test_planner_parts_are_importable_where_torchrec_has_them():
    topology, ebc = Topology(2, "cpu"), _ebc()
    default = EmbeddingShardingPlanner(topology).plan(ebc)
    estimators = [EmbeddingPerfEstimator(topology), EmbeddingStorageEstimator(topology)]
    explicit = EmbeddingShardingPlanner(topology, enumerator=EmbeddingEnumerator(topology, 512, estimator=estimators),
                                        partitioner=GreedyPerfPartitioner()).plan(ebc)
    assert explicit == default
    assert isinstance(EmbeddingShardingPlanner(topology), ShardingPlanner)
    with pytest.raises(TypeError, match="EmbeddingEnumerator"):
        EmbeddingShardingPlanner(topology, enumerator=Enumerator(topology))
    with pytest.raises(ValueError, match="SortBy.STORAGE"):
        GreedyPerfPartitioner(sort_by=SortBy.PERF)
    with pytest.raises(ValueError, match="is_inference"):
        EmbeddingPerfEstimator(topology, is_inference=True)
    with pytest.raises(ValueError, match="dynamic-programming"):
        DynamicProgrammingProposer()
    with pytest.raises(ValueError, match="UVM"):
        EmbeddingOffloadScaleupProposer()
    with pytest.raises(ValueError, match="callbacks"):
        EmbeddingShardingPlanner(topology, callbacks=[lambda options: options])
    with pytest.raises(ValueError, match="ShardingPlan.load"):
        EmbeddingShardingPlanner(topology, plan_loader=object())


def test_what_the_sharders_and_env_cannot_honour_is_refused():
    with pytest.raises(ValueError, match="qcomm"):
        EmbeddingBagCollectionSharder(qcomm_codecs_registry={"forward": object()})
    with pytest.raises(ValueError, match="qcomm"):
        EmbeddingCollectionSharder(qcomm_codecs_registry={"forward": object()})
    with pytest.raises(ValueError, match="sharded_module_order_overwrite"):
        EmbeddingBagCollectionSharder(sharded_module_order_overwrite=["row_wise"])
    with pytest.raises(ValueError, match="DTensor"):
        ShardingEnv(2, 0, output_dtensor=True)


# -- DMP and shard_modules on 2 gloo ranks -----------------------------------------------------------------------


class SeqTower(nn.Module):
    """A model whose only embedding module is an EmbeddingCollection."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.ec = EmbeddingCollection([EmbeddingConfig(name="seq", num_embeddings=9, embedding_dim=DIM, feature_names=["s"])],
                                      device=torch.device(device))
        self.out = nn.Linear(DIM, 1, device=device)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        jt = self.ec(kjt)["s"]
        example = torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths().long())
        return self.out(torch.zeros(jt.lengths().numel(), DIM).index_add(0, example, jt.values()))


class BagTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="bag", num_embeddings=7, embedding_dim=DIM, feature_names=["s"])])
        self.out = nn.Linear(DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.out(self.ebc(kjt).values())


def _batch(step: int, first: int, count: int, world_size: int, rows: int = 7):
    g = torch.Generator().manual_seed(step)
    n = world_size * LOCAL_BATCH
    lengths = torch.randint(1, 4, (n,), generator=g)
    ids = [torch.randint(0, rows, (int(k),), generator=g) for k in lengths]
    target = torch.randn(n, 1, generator=g)
    pick = slice(first, first + count)
    return KeyedJaggedTensor(keys=["s"], values=torch.cat(ids[pick]), lengths=lengths[pick].int()), target[pick]


class _Recorder(DataParallelWrapper):
    """A user's wrapper (TorchRec's interface): DDP with static_graph, and a note that it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def wrap(self, dmp, env, device) -> None:
        self.calls += 1
        DefaultDataParallelWrapper(static_graph=True).wrap(dmp, env, device)


def _worker(rank: int, world_size: int, steps: int):
    out = {}
    # only an EmbeddingCollectionSharder for a model whose only embedding module is an EmbeddingCollection
    torch.manual_seed(0)
    model = SeqTower()
    wrapper = _Recorder()
    sgd = {"optimizer": "EXACT_SGD", "learning_rate": LR}  # the EC's table is sharded (row-wise): its fused optimizer
    dmp = DistributedModelParallel(model, sharders=[EmbeddingCollectionSharder(sgd)], init_data_parallel=False,
                                   data_parallel_wrapper=wrapper)
    out["wrapped_before"] = isinstance(dmp._dmp_wrapped_module, DistributedDataParallel)
    dmp.init_data_parallel()
    dmp.init_data_parallel()  # once only
    out["wrapped_after"], out["wrapper_calls"] = isinstance(dmp._dmp_wrapped_module, DistributedDataParallel), wrapper.calls
    out["plan"] = {n: ps.sharding_type.value for n, ps in dmp.plan.get_plan_for_module("ec").items()}
    opt = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    for step in range(steps):
        kjt, target = _batch(step, rank * LOCAL_BATCH, LOCAL_BATCH, world_size, rows=9)
        nn.functional.mse_loss(dmp(kjt), target).backward()
        opt.step()
        opt.zero_grad()
    out["seq"] = dmp.module.ec.gather_table("seq")
    # init_parameters=False leaves meta-device dense modules on meta until the data-parallel wrap
    meta = DistributedModelParallel(SeqTower(device="meta"), sharders=[EmbeddingCollectionSharder()],
                                    init_data_parallel=False, init_parameters=False)
    out["meta_left"] = meta.module.out.weight.is_meta
    early = DistributedModelParallel(SeqTower(device="meta"), sharders=[EmbeddingCollectionSharder()], init_data_parallel=False)
    out["early_meta"] = early.module.out.weight.is_meta  # TorchRec: init_parameters acts in the constructor
    # shard_modules: the EBC sharded in place, no DDP, forward equal to the unsharded model's rows
    torch.manual_seed(1)
    bag = BagTower()
    full, _ = _batch(7, 0, world_size * LOCAL_BATCH, world_size)
    want = bag(full)[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH].detach()
    sharded = shard_modules(bag, sharders=[EmbeddingBagCollectionSharder()])
    local, _ = _batch(7, rank * LOCAL_BATCH, LOCAL_BATCH, world_size)
    out["shard_modules"] = (sharded is bag, type(bag.ebc).__name__, (sharded(local).detach() - want).abs().max().item())
    # a sharded type with the dense kernel: TorchRec runs it, recship refuses naming the table
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(BagTower().ebc, {"bag": table_wise(rank=0, compute_kernel="dense")},
                                                               world_size=world_size, device_type="cpu")})
    try:
        DistributedModelParallel(BagTower(), plan=plan)
        out["dense_tw"] = "no error"
    except ValueError as e:
        out["dense_tw"] = str(e)
    return out


def test_dmp_and_shard_modules_take_torchrecs_arguments():
    world_size, steps = 2, 2
    results = run_ranks(_worker, world_size, steps)
    torch.manual_seed(0)
    reference = SeqTower()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(steps):
        kjt, target = _batch(step, 0, world_size * LOCAL_BATCH, world_size, rows=9)
        nn.functional.mse_loss(reference(kjt), target).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    assert not torch.equal(reference.ec.embeddings["seq"].weight, SeqTower().ec.embeddings["seq"].weight)  # it trained
    for r in results:
        assert (r["wrapped_before"], r["wrapped_after"], r["wrapper_calls"]) == (False, True, 1)
        assert r["plan"] == {"seq": "row_wise"}  # as TorchRec 1.8.0 plans it
        torch.testing.assert_close(results[0]["seq"], reference.ec.embeddings["seq"].weight.detach(), atol=1e-6, rtol=0)
        assert r["meta_left"] is True and r["early_meta"] is False
        same, kind, err = r["shard_modules"]
        assert same and kind == "ShardedEmbeddingBagCollection" and err < 1e-6
        assert "table 'bag' is planned 'table_wise' with compute kernel 'dense'" in r["dense_tw"]
