"""The quantized collections under TorchRec's constructors (``torchrec.quant.embedding_modules``): tables typed by
their ``data_type``, rows from ``quantize_state_dict`` (fbgemm's row-wise bytes; checked bit-equal to TorchRec
1.8.0's in a throwaway venv), pruned tables, ``need_indices``, and TorchRec's fx-name and meta helpers."""

import dataclasses

import pytest
import torch

from recship.names import DataType, PoolingType
from recship.quantize import embedding_modules as qem
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

BITS = {DataType.INT8: 8, DataType.INT4: 4}


def _kjt(keys, batch: int = 5, high: int = 20) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g, dtype=torch.int32)
    return KeyedJaggedTensor(keys=keys, values=(torch.rand(int(lengths.sum()), generator=g) * high).long(), lengths=lengths)


def _dequantized(weight: torch.Tensor, data_type: DataType) -> torch.Tensor:
    if data_type == DataType.FP16:
        return weight.detach().half().float()
    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight.detach().contiguous(), BITS[data_type])
    return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, BITS[data_type])


def test_torchrec_constructor_with_quantize_state_dict_rows():
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=40, feature_names=["a"], data_type=DataType.INT8),
              EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=30, feature_names=["b"], data_type=DataType.INT4,
                                 pooling=PoolingType.MEAN),
              EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=20, feature_names=["c"], data_type=DataType.FP16)]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([dataclasses.replace(t, data_type=DataType.FP32) for t in tables])
    weights = {}
    assert qem.quantize_state_dict(ebc, weights, {t.name: t.data_type for t in tables}, {"t0": 25}) == torch.device("cpu")
    assert weights["t0"][0].shape == (25, 8) and weights["t1"][0].shape == (30, 8) and weights["t2"][1] is None
    pruned = [dataclasses.replace(tables[0], num_embeddings=25), *tables[1:]]
    q = qem.EmbeddingBagCollection(pruned, is_weighted=False, device=torch.device("cpu"), table_name_to_quantized_weights=weights)
    assert q.embedding_bags["t0"].weight.shape == (25, 16)  # 8 + 4 bytes, padded to TorchRec's 16
    kjt = _kjt(["a", "b", "c"], high=20)
    jts = kjt.to_dict()
    for name, feature, mode in (("t0", "a", "sum"), ("t1", "b", "mean"), ("t2", "c", "sum")):
        rows = _dequantized(ebc.embedding_bags[name].weight, dict((t.name, t.data_type) for t in tables)[name])
        jt = jts[feature]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), jt.lengths().long().cumsum(0)])[:-1]
        want = torch.nn.functional.embedding_bag(jt.values(), rows, offsets, mode=mode)
        torch.testing.assert_close(q(kjt)[feature], want, atol=2e-6, rtol=1e-6)
    split = qem.EmbeddingBagCollection(pruned, False, "cpu", table_name_to_quantized_weights=weights, register_tbes=True,
                                       quant_state_dict_split_scale_bias=True)
    assert {"embedding_bags.t0.weight_qscale", "tbes.0.weights_tys"} <= set(split.state_dict())
    with pytest.raises(ValueError, match="do not fit"):
        qem.EmbeddingBagCollection(tables, False, "cpu", table_name_to_quantized_weights=weights)  # t0: 25 rows given, 40 held
    with pytest.raises(ValueError, match="output_dtype"):
        qem.EmbeddingBagCollection(tables, False, "cpu", output_dtype=torch.int8)


def test_unpooled_collection_gives_its_indices():
    table = EmbeddingConfig(name="e0", embedding_dim=8, num_embeddings=20, feature_names=["a"])
    torch.manual_seed(0)
    ec = EmbeddingCollection([table])
    weights = {}
    qem.quantize_state_dict(ec, weights, {"e0": DataType.INT8})
    q = qem.EmbeddingCollection([dataclasses.replace(table, data_type=DataType.INT8)], device="cpu", need_indices=True,
                                table_name_to_quantized_weights=weights)
    kjt = _kjt(["a"])
    out = q(kjt)["a"]
    assert q.need_indices() and torch.equal(out.weights(), kjt.values())
    torch.testing.assert_close(out.values(), _dequantized(ec.embeddings["e0"].weight, DataType.INT8)[kjt.values()], atol=0, rtol=0)


def test_fx_names_and_meta_placement():
    from recship.quantize.sharded import shard_quant_model

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10, feature_names=[f"f{i}"], data_type=DataType.INT8)
              for i in range(2)]
    q = qem.EmbeddingBagCollection(tables, False, "cpu")
    model = torch.nn.Sequential(q)
    qem.recursive_populate_fx_names(model)
    assert q.tbes[0]._fx_path == "emb_module.t0,t1"
    sharded, _ = shard_quant_model(q, shards=2)
    qem.populate_fx_names(sharded)
    assert sharded.shards[1].tbes[0]._fx_path == "embedding_lookup.sharding_1.group_0.tbe"
    qem.meta_to_cpu_placement(model)  # nothing on meta: nothing to move
    ebc = EmbeddingBagCollection([dataclasses.replace(t, data_type=DataType.FP32) for t in tables], device="meta")
    weights = {}
    assert qem.quantize_state_dict(ebc, weights, {"t0": DataType.INT8, "t1": DataType.FP16}).type == "meta"
    assert weights["t0"][0].shape == (10, 8) and weights["t0"][1].shape == (10, 4) and weights["t1"][0].shape == (10, 16)
