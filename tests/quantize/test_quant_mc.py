"""Quantized managed-collision collections (QuantManagedCollisionEmbedding(Bag)Collection) and their inference sharders.

A float MC-EBC / MC-EC is trained a few batches (its slots fill and evict), then quantized. The reference is plain
torch: each raw id looked up in the trained ``_mch_sorted_raw_ids`` / ``_mch_remapped_ids_mapping`` (a dict; a miss
goes to the last row), the rows read back from the quantized bytes (codes * scale + bias, fp16 scale and bias), then
summed per bag. TorchRec 1.8.0 gave bit-equal remapped ids, outputs and state_dicts for the same trained state
(checked outside the suite; the report of the change says how).
"""

from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn
from torch.ao import quantization as quant

from recship.distributed import (InferManagedCollisionCollectionSharder, QuantEmbeddingBagCollectionSharder,
                                 QuantEmbeddingCollectionSharder, QuantManagedCollisionEmbeddingCollectionSharder, ShardingEnv,
                                 ShardingPlan, _shard_modules)
from recship.inference import quantize_embeddings
from recship.quantize.embedding_modules import (QuantEmbeddingBagCollection, QuantEmbeddingCollection,
                                                QuantManagedCollisionEmbeddingBagCollection, QuantManagedCollisionEmbeddingCollection)
from recship.quantize.managed_collisions import ManagedCollisionLookup
from recship.quantize.sharders import QuantManagedCollisionEmbeddingBagCollectionSharder
from recship.sparse import KeyedJaggedTensor
from recship.trainer import DataType, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from recship.trainer.managed_collisions import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                                ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection,
                                                MCHManagedCollisionModule)
from recship.trainer.planner.types import EmbeddingComputeKernel, ParameterSharding, ShardingType, ShardMetadata

HASH = 1000
FEATURES = ["f0", "f1", "f2"]
QCONFIG = quant.QConfig(activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
                        weight=quant.PlaceholderObserver.with_args(dtype=torch.qint8))


def _kjts(seed: int, n: int) -> List[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 6, (12,), generator=g)
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=torch.randint(0, HASH, (int(lengths.sum()),), generator=g),
                                                       lengths=lengths))
    return out


def _trained(bag: bool) -> nn.Module:
    """A managed-collision collection after 3 training batches (slots filled, some evicted), in eval mode."""
    torch.manual_seed(0)
    config = EmbeddingBagConfig if bag else EmbeddingConfig
    tables = [config(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0", "f1"]),
              config(name="t1", embedding_dim=4 if bag else 8, num_embeddings=10, feature_names=["f2"])]
    modules = {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=torch.device("cpu"), eviction_interval=1,
                                                 eviction_policy=DistanceLFU_EvictionPolicy(), input_hash_size=HASH) for t in tables}
    mcc = ManagedCollisionCollection(modules, tables)  # type: ignore[arg-type]
    if bag:
        module: nn.Module = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), mcc, return_remapped_features=True)  # type: ignore[arg-type]
    else:
        module = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables), mcc, return_remapped_features=True)  # type: ignore[arg-type]
    for kjt in _kjts(1, 3):
        module(kjt)
    return module.eval()


def _reference_remap(mc: nn.Module, kjt: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
    """feature -> its remapped ids, from the trained buffers by a dict (miss: the table's last row)."""
    out = {}
    for table, m in mc._managed_collision_collection._managed_collision_modules.items():
        raw, rows = m._mch_sorted_raw_ids[:-1].tolist(), m._mch_remapped_ids_mapping[:-1].tolist()
        slot = dict(zip(raw, rows))
        for f in mc._managed_collision_collection._table_to_features[table]:
            out[f] = torch.tensor([slot.get(x, m._zch_size - 1) for x in kjt[f].values().tolist()], dtype=torch.int64)
    return out


def _rows(q: nn.Module) -> Dict[str, torch.Tensor]:
    """table -> the float32 values the quantized bytes hold: codes * fp16 scale + fp16 bias, an INT8 code per byte,
    two INT4 codes per byte (low nibble first)."""
    out = {}
    for t in q.tables():
        data, scale_bias = q.table_weights()[t.name]
        sb = scale_bias.contiguous().view(torch.float16).float()
        if q.weight_types()[t.name] == DataType.INT4:
            nibbles = torch.stack([data & 0xF, data >> 4], dim=2).reshape(data.shape[0], -1)
            codes = nibbles[:, : t.embedding_dim]
        else:
            codes = data[:, : t.embedding_dim]
        out[t.name] = codes.float() * sb[:, 0:1] + sb[:, 1:2]
    return out


def _feature_rows(q: nn.Module) -> Dict[str, torch.Tensor]:
    rows = _rows(q)
    return {f: rows[t.name] for t in q.tables() for f in t.feature_names}


@pytest.mark.parametrize("how", ["from_float", "quantize_dynamic", "inference.quantize_embeddings"])
def test_bags_equal_the_dequantized_reference(how: str) -> None:
    mc = _trained(bag=True)
    kind = DataType.INT8
    if how == "from_float":
        mc.qconfig = QCONFIG
        q = QuantManagedCollisionEmbeddingBagCollection.from_float(mc)
    elif how == "inference.quantize_embeddings":  # TorchRec's helper, its min/max INT4 rows
        kind = DataType.INT4
        holder = nn.ModuleDict({"mc": mc})
        quantize_embeddings(holder, dtype=torch.quint4x2, inplace=True, additional_qconfig_spec_keys=[ManagedCollisionEmbeddingBagCollection],
                            additional_mapping={ManagedCollisionEmbeddingBagCollection: QuantManagedCollisionEmbeddingBagCollection})
        q = holder["mc"]
    else:  # TorchRec's way: the inner collection is swapped first, then the managed-collision module
        holder = nn.ModuleDict({"mc": mc})
        quant.quantize_dynamic(holder, qconfig_spec={EmbeddingBagCollection: QCONFIG, ManagedCollisionEmbeddingBagCollection: QCONFIG},
                               mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection,
                                        ManagedCollisionEmbeddingBagCollection: QuantManagedCollisionEmbeddingBagCollection}, inplace=True)
        q = holder["mc"]
    assert type(q) is QuantManagedCollisionEmbeddingBagCollection
    assert q.weight_types() == {"t0": kind, "t1": kind}
    rows = _feature_rows(q)
    for kjt in _kjts(7, 2):
        pooled, remapped = q(kjt)
        want_ids = _reference_remap(q, kjt)
        got = remapped.to_dict()
        want = []
        for f in FEATURES:
            assert torch.equal(got[f].values(), want_ids[f]), f
            bags = torch.split(rows[f][want_ids[f]], kjt[f].lengths().tolist())
            want.append(torch.stack([b.sum(0) if len(b) else torch.zeros(rows[f].shape[1]) for b in bags]))
        assert pooled.keys() == FEATURES
        torch.testing.assert_close(pooled.values(), torch.cat(want, dim=1), rtol=0, atol=1e-6)


def test_sequences_equal_the_dequantized_reference() -> None:
    mc = _trained(bag=False)
    float_out, float_remapped = mc(_kjts(7, 1)[0])
    mc.qconfig = QCONFIG
    q = QuantManagedCollisionEmbeddingCollection.from_float(mc)
    rows = _feature_rows(q)
    kjt = _kjts(7, 1)[0]
    out, remapped = q(kjt)
    assert torch.equal(remapped.values(), float_remapped.values())  # the float module's slots, carried over
    want_ids = _reference_remap(q, kjt)
    for f in FEATURES:
        assert torch.equal(out[f].values(), rows[f][want_ids[f]])  # one row each: no sum, exact
        assert torch.equal(out[f].lengths(), kjt[f].lengths())
        assert (out[f].values() - float_out[f].values()).abs().max() < 0.01  # int8 of N(0, 1/n)-ish rows


def test_state_dict_keys_are_torchrecs() -> None:
    mch = ["_output_segments_tensor", "_current_iter_tensor", "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts",
           "_mch_last_access_iter"]
    for bag, container, cls in ((True, "embedding_bags", QuantManagedCollisionEmbeddingBagCollection),
                                (False, "embeddings", QuantManagedCollisionEmbeddingCollection)):
        mc = _trained(bag)
        mc.qconfig = QCONFIG
        q = cls.from_float(mc)
        want = [f"{container}.t0.weight", f"{container}.t1.weight"] + [
            f"_managed_collision_collection._managed_collision_modules.{t}.{b}" for t in ("t0", "t1") for b in mch]
        assert sorted(q.state_dict()) == sorted(want)
        other = _trained(bag)
        other.qconfig = QCONFIG
        fresh = cls.from_float(other)
        for _, m in fresh._managed_collision_collection._managed_collision_modules.items():
            m.reset_parameters()  # no slots: every id misses
        for data, _ in fresh.table_weights().values():
            data.zero_()
        fresh.load_state_dict(q.state_dict())
        kjt = _kjts(9, 1)[0]
        (a, a_ids), (b, b_ids) = q(kjt), fresh(kjt)
        assert torch.equal(a_ids.values(), b_ids.values())
        if bag:
            assert torch.equal(a.values(), b.values())
        else:
            assert all(torch.equal(a[f].values(), b[f].values()) for f in FEATURES)


def test_constructor_and_from_float_errors() -> None:
    mc = _trained(bag=True)
    tables = mc._embedding_module.embedding_bag_configs()
    with pytest.raises(ValueError, match="needs a managed_collision_collection"):
        QuantManagedCollisionEmbeddingBagCollection(tables, False, "cpu")
    with pytest.raises(ValueError, match="must be the same"):
        QuantManagedCollisionEmbeddingBagCollection(tables[:1], False, "cpu", managed_collision_collection=mc._managed_collision_collection)
    with pytest.raises(TypeError, match="ManagedCollisionEmbeddingBagCollection"):
        QuantManagedCollisionEmbeddingBagCollection.from_float(mc._embedding_module)
    with pytest.raises(ValueError, match="no qconfig"):
        QuantManagedCollisionEmbeddingBagCollection.from_float(mc)


def test_fx_trace_runs_the_same() -> None:
    mc = _trained(bag=True)
    mc.qconfig = QCONFIG
    q = QuantManagedCollisionEmbeddingBagCollection.from_float(mc)
    traced = torch.fx.symbolic_trace(q)
    kjt = _kjts(3, 1)[0]
    (want, want_ids), (got, got_ids) = q(kjt), traced(kjt)
    assert torch.equal(got.values(), want.values()) and torch.equal(got_ids.values(), want_ids.values())


def _plan(kind: ShardingType, tables: List[Tuple[str, int, int]]) -> Dict[str, ParameterSharding]:
    """table -> row-wise over ranks 0, 1 (two halves) or table-wise on rank 1."""
    out = {}
    for name, rows, dim in tables:
        if kind == ShardingType.ROW_WISE:
            shards = [ShardMetadata([0, 0], [rows // 2, dim], 0, "cpu"), ShardMetadata([rows // 2, 0], [rows - rows // 2, dim], 1, "cpu")]
            out[name] = ParameterSharding(kind, EmbeddingComputeKernel.QUANT, [0, 1], shards)
        else:
            out[name] = ParameterSharding(kind, EmbeddingComputeKernel.QUANT, [1], [ShardMetadata([0, 0], [rows, dim], 1, "cpu")])
    return out


@pytest.mark.parametrize("kind", [ShardingType.ROW_WISE, ShardingType.TABLE_WISE])
def test_inference_sharding_answers_as_unsharded(kind: ShardingType) -> None:
    mc = _trained(bag=True)
    mc.qconfig = QCONFIG
    q = QuantManagedCollisionEmbeddingBagCollection.from_float(mc)
    kjt = _kjts(5, 1)[0]
    want, want_ids = q(kjt)
    sharder = QuantManagedCollisionEmbeddingBagCollectionSharder(QuantEmbeddingBagCollectionSharder(), InferManagedCollisionCollectionSharder())
    assert sharder.sharding_types("cpu") == ["table_wise", "row_wise", "column_wise"]
    model = nn.ModuleDict({"mc": q})
    plan = ShardingPlan({"mc": _plan(kind, [("t0", 20, 8), ("t1", 10, 4)])})
    _shard_modules(model, env=ShardingEnv.from_local(2, 0), device=torch.device("cpu"), plan=plan, sharders=[sharder])
    sharded = model["mc"]
    assert isinstance(sharded, ManagedCollisionLookup)
    got, got_ids = sharded(kjt)
    assert torch.equal(got_ids.values(), want_ids.values())
    torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)  # row blocks: partial sums added


def test_inference_sharders_of_sequences() -> None:
    mc = _trained(bag=False)
    mc.qconfig = QCONFIG
    q = QuantManagedCollisionEmbeddingCollection.from_float(mc)
    kjt = _kjts(5, 1)[0]
    want, want_ids = q(kjt)
    sharder = QuantManagedCollisionEmbeddingCollectionSharder(QuantEmbeddingCollectionSharder(), InferManagedCollisionCollectionSharder())
    assert sharder.sharding_types("cpu") == ["table_wise"]  # the unpooled tables stay whole on one rank
    with pytest.raises(TypeError, match="e_sharder must be a QuantEmbeddingCollectionSharder"):
        QuantManagedCollisionEmbeddingCollectionSharder(QuantEmbeddingBagCollectionSharder(), InferManagedCollisionCollectionSharder())
    with pytest.raises(ValueError, match="sharding types it does not take"):
        sharder.shard(q, _plan(ShardingType.ROW_WISE, [("t0", 20, 8), ("t1", 10, 8)]), ShardingEnv.from_local(2, 0), "cpu")
    placed = sharder.shard(q, _plan(ShardingType.TABLE_WISE, [("t0", 20, 8), ("t1", 10, 8)]), ShardingEnv.from_local(2, 0), "cpu")
    assert isinstance(placed, QuantManagedCollisionEmbeddingCollection)
    got, got_ids = placed(kjt)
    assert torch.equal(got_ids.values(), want_ids.values())
    assert all(torch.equal(got[f].values(), want[f].values()) for f in FEATURES)


def test_without_sharders_a_quantized_mc_ebc_keeps_its_remapping() -> None:
    mc = _trained(bag=True)
    mc.qconfig = QCONFIG
    q = QuantManagedCollisionEmbeddingBagCollection.from_float(mc)
    kjt = _kjts(4, 1)[0]
    want, want_ids = q(kjt)
    sharded = _shard_modules(q, env=ShardingEnv.from_local(2, 0), device="cpu")
    assert isinstance(sharded, ManagedCollisionLookup)
    got, got_ids = sharded(kjt)
    assert torch.equal(got_ids.values(), want_ids.values()) and torch.equal(got.values(), want.values())  # table-wise: same sums
