"""TorchRec's ``torchrec.distributed.types`` / ``planner.types`` / ``fbgemm_qcomm_codec`` vocabulary on recship: what
each name does (awaitables, codecs, helpers), Topology's TorchRec parameters honoured or refused, and
``fx.symbolic_trace``'s ``concrete_args``."""

import pytest
import torch
from torch import nn

from recship import fx
from recship.distributed import (HBM_CAP, DDR_CAP, CacheParams, CommType, GetItemLazyAwaitable, LazyGetItemMixin,
                                 LazyNoWait, NoOpQuantizedCommCodec, ParameterConstraints, QCommsConfig,
                                 QuantizedCommCodecs, ShardedEmbeddingBagCollection, ShardedModule, Topology, bytes_to_gb,
                                 gb_to_bytes, get_qcomm_codecs, get_qcomm_codecs_registry, get_tensor_size_bytes, prod,
                                 rank_device, sharder_name, EmbeddingBagCollectionSharder)
from recship.trainer.distributed.types import LazyAwaitable


def test_topology_takes_torchrecs_parameters_and_defaults():
    with pytest.raises(TypeError):
        Topology(2)  # TorchRec requires compute_device
    cuda = Topology(2, "cuda")
    assert (cuda.hbm_cap, cuda.ddr_cap, cuda.capacity) == (32 * 1024**3, 128 * 1024**3, 32 * 1024**3)
    assert (HBM_CAP, DDR_CAP) == (32 * 1024**3, 128 * 1024**3)
    cpu = Topology(world_size=4, compute_device="cpu", hbm_cap=None, ddr_cap=10, local_world_size=2, pod_size=4)
    assert (cpu.capacity, cpu.num_hosts) == (10, 2)


@pytest.mark.parametrize("kwargs,words", [
    ({"intra_host_bw": 1.0}, "intra_host_bw=1.0"),
    ({"bwd_compute_multiplier": 3}, "bwd_compute_multiplier=3"),
    ({"pod_size": 2}, "pod_size=2"),
    ({"custom_topology_data": object()}, "custom_topology_data"),
])
def test_topology_refuses_what_recships_cost_model_does_not_weigh(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Topology(4, "cpu", **kwargs)


def test_cache_params_exist_so_that_their_refusal_is_clear():
    with pytest.raises(ValueError, match="UVM cache"):
        ParameterConstraints(cache_params=CacheParams(load_factor=0.2))


def test_sharded_modules_are_sharded_modules():
    assert issubclass(ShardedEmbeddingBagCollection, ShardedModule)

    class Sharded(ShardedModule):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    assert Sharded().qcomm_codecs_registry is None and isinstance(Sharded().create_context(), object)
    with pytest.raises(ValueError, match="fp32"):
        Sharded(qcomm_codecs_registry={"x": QuantizedCommCodecs()})


def test_lazy_awaitables_wait_for_what_they_hold():
    calls = []

    class Parent(LazyGetItemMixin[str, torch.Tensor], LazyAwaitable[dict]):
        def _wait_impl(self) -> dict:
            calls.append(1)
            return {"a": torch.arange(3.0), "b": torch.ones(2)}

    parent = Parent()
    item = parent["a"]
    assert isinstance(item, GetItemLazyAwaitable) and calls == []  # indexing did not wait
    assert torch.equal(item.wait(), torch.arange(3.0)) and calls == [1]
    assert torch.equal(item + 1, torch.arange(3.0) + 1)  # used as its result
    held = torch.randn(4)
    assert LazyNoWait(held).wait() is held


def test_qcomm_codecs_are_fp32_or_refused():
    codec = NoOpQuantizedCommCodec()
    x = torch.randn(5)
    assert codec.encode(x) is x and codec.decode(x) is x and codec.calc_quantized_size(7) == 7
    assert codec.quantized_dtype == torch.float
    assert get_qcomm_codecs_registry(QCommsConfig()) is None
    assert isinstance(get_qcomm_codecs(None).forward, NoOpQuantizedCommCodec)
    with pytest.raises(ValueError, match="forward_precision=CommType.FP16"):
        get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16))
    EmbeddingBagCollectionSharder(qcomm_codecs_registry=get_qcomm_codecs_registry(QCommsConfig()))  # TorchRec's CPU path


def test_helpers():
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda", 3) == torch.device("cuda", 3)
    t = torch.zeros(10, 3, dtype=torch.float16)
    assert get_tensor_size_bytes(t) == 10 * 3 * 2
    assert prod([2, 3, 4]) == 24 and prod([]) == 1
    assert bytes_to_gb(gb_to_bytes(1.5)) == 1.5
    assert sharder_name(EmbeddingBagCollectionSharder) == f"{EmbeddingBagCollectionSharder.__module__}.EmbeddingBagCollectionSharder"


def test_symbolic_trace_takes_concrete_args():
    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
            return x * 2 if double else x + 1

    x = torch.randn(3)
    doubled = fx.symbolic_trace(Scaled(), concrete_args={"double": True})
    assert torch.equal(doubled(x, True), x * 2)  # fx checks the specialised value, as torch.fx.symbolic_trace
    plain = fx.symbolic_trace(root=Scaled(), concrete_args={"double": False})
    assert torch.equal(plain(x, False), x + 1)


def test_torchrec_optim_is_reached_as_an_attribute_too():
    """`import torchrec` then `torchrec.optim.X` (TorchRec's tests write it): recship keeps torchrec.optim in
    recship.distributed (the import map), and the attribute path reaches it."""
    import recship as torchrec
    import recship.distributed

    assert torchrec.optim is recship.distributed
    assert torchrec.optim.RowWiseAdagrad is recship.distributed.RowWiseAdagrad
    with pytest.raises(AttributeError):
        torchrec.no_such_name


def test_pad_vbe_kjt_lengths_pads_each_key_to_the_largest_batch():
    from recship.distributed import ShardedEmbeddingCollection, ShardedEmbeddingModule, pad_vbe_kjt_lengths
    from recship.sparse import KeyedJaggedTensor

    assert issubclass(ShardedEmbeddingCollection, ShardedEmbeddingModule)
    g = torch.Generator().manual_seed(0)
    strides = [2, 4, 1]
    lengths = torch.randint(0, 4, (sum(strides),), generator=g)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths,
                            stride_per_key_per_rank=[[s] for s in strides])
    padded = pad_vbe_kjt_lengths(kjt)
    want, start = [], 0
    for n in strides:  # plain reference: each key's lengths then zeros up to the largest batch
        want += lengths[start:start + n].tolist() + [0] * (max(strides) - n)
        start += n
    assert padded.stride() == 4 and padded.lengths().tolist() == want
    assert torch.equal(padded.values(), values)
    for key in "abc":  # the same ids per key
        assert torch.equal(padded[key].values(), kjt[key].values())


def test_ec_index_dedup_switch_is_recorded():
    from recship.distributed import get_ec_index_dedup, set_ec_index_dedup

    assert get_ec_index_dedup() is False
    set_ec_index_dedup(True)
    try:
        assert get_ec_index_dedup() is True
    finally:
        set_ec_index_dedup(False)


@pytest.mark.parametrize("rows,dim,world", [(10, 64, 4), (5, 16, 4), (7, 8, 2), (1, 4, 3)])
def test_calculated_shards_are_the_ones_recships_plans_hold(rows, dim, world):
    import math

    from recship import EmbeddingBagCollection, EmbeddingBagConfig
    from recship.distributed import (ShardingType, calculate_shard_sizes_and_offsets, column_wise,
                                     construct_module_sharding_plan, row_wise)

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows,
                                                            feature_names=["f"])], device=torch.device("meta"))
    weight = ebc.embedding_bags["t"].weight
    sizes, offsets = calculate_shard_sizes_and_offsets(weight, world, world, "row_wise")
    block = math.ceil(rows / world)  # plain arithmetic: ceil blocks, empty ones left out
    assert sizes == [[min(block, rows - r0), dim] for r0 in range(0, rows, block)]
    assert offsets == [[r0, 0] for r0 in range(0, rows, block)]
    blocks = min(world, dim // 4)  # column blocks: as many as ranks, each at least 4 wide
    for kind, helper in ((ShardingType.ROW_WISE, row_wise()), (ShardingType.COLUMN_WISE, column_wise(list(range(blocks))))):
        ps = construct_module_sharding_plan(ebc, {"t": helper}, local_size=world, world_size=world, device_type="cpu")["t"]
        got = calculate_shard_sizes_and_offsets(weight, world, world, kind.value)
        assert got == ([s.shard_sizes for s in ps.shards], [s.shard_offsets for s in ps.shards])
    assert calculate_shard_sizes_and_offsets(weight, world, world, "data_parallel") == ([[rows, dim]] * world, [[0, 0]] * world)
    with pytest.raises(ValueError, match="device_memory_sizes"):
        calculate_shard_sizes_and_offsets(weight, world, world, "row_wise", device_memory_sizes=[1] * world)


def test_placements_and_helpers_by_type():
    from recship.distributed import (EmbeddingBagCollectionSharder, EmbeddingCollectionSharder, ShardingType,
                                     get_module_to_default_sharders, get_sharding_constructor_from_type, placement,
                                     placement_helper, row_wise, table_wise)
    from recship import EmbeddingBagCollection, EmbeddingCollection

    assert placement("cpu", 3, 2) == "rank:3/cpu" and placement("cuda", 3, 2) == "rank:3/cuda:1"
    assert placement_helper("cpu", 2, 5) == "rank:0/cpu" and placement_helper("cuda", 2, 5) == "rank:5/cuda:2"
    assert get_sharding_constructor_from_type(ShardingType.ROW_WISE) is row_wise
    assert get_sharding_constructor_from_type(ShardingType.TABLE_WISE) is table_wise
    sharders = get_module_to_default_sharders()
    assert isinstance(sharders[EmbeddingBagCollection], EmbeddingBagCollectionSharder)
    assert isinstance(sharders[EmbeddingCollection], EmbeddingCollectionSharder)
