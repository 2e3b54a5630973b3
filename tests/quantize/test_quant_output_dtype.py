"""The quantized collections' ``output_dtype`` (TorchRec's; torch's QConfig says it as the activation observer's
dtype): float16 and bfloat16 results are fbgemm's float32 pooling converted once at the end, so they equal the
float32 module's output cast to that dtype (fbgemm's rounding), bit for bit (checked against TorchRec 1.8.0 in a throwaway venv:
bit-equal outputs for INT8/INT4/FP16 rows, SUM/MEAN, weighted or not). Export, serving and inference sharding
take float32 collections: a half-output one is refused there by name.

References are plain torch: each table's stored rows decoded byte by byte and pooled bag by bag.
"""

import pytest
import torch
from torch import quantization as quant

from recship.names import DataType, PoolingType
from recship.quantize import QuantConfig
from recship.quantize import embedding_modules as qem
from recship.quantize.flat import FlatEmbeddingCollection, FlatPooledLookup
from recship.quantize.sharded import shard_quant_model
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

WEIGHT = {DataType.INT8: torch.qint8, DataType.FP16: torch.half}


def _qconfig(output: torch.dtype, weight: torch.dtype) -> quant.QConfig:
    return quant.QConfig(activation=quant.PlaceholderObserver.with_args(dtype=output),
                         weight=quant.PlaceholderObserver.with_args(dtype=weight))


def _kjt(keys, batch: int = 6, high: int = 20, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 5, (len(keys) * batch,), generator=g, dtype=torch.int32)
    n = int(lengths.sum())
    return KeyedJaggedTensor(keys=keys, values=torch.randint(0, high, (n,), generator=g), lengths=lengths,
                             weights=torch.rand(n, generator=g) if weighted else None)


def _decoded(data: torch.Tensor, scale_bias, data_type: DataType, dim: int) -> torch.Tensor:
    """A table's stored rows (``table_weights()``: data [rows, data bytes] uint8 and, for integer types,
    scale/bias [rows, 4] uint8 = fp16 scale | fp16 bias) -> [rows, dim] float32."""
    if data_type == DataType.FP16:
        return data[:, : 2 * dim].contiguous().view(torch.float16).float()
    scale = scale_bias[:, 0:2].contiguous().view(torch.float16).float()
    bias = scale_bias[:, 2:4].contiguous().view(torch.float16).float()
    return data[:, :dim].float() * scale + bias  # INT8: one byte per code


def _pooled(rows: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, weights, mean: bool) -> torch.Tensor:
    """[B, dim]: each bag's (weighted) sum of rows, divided by its id count for MEAN (an empty bag is 0)."""
    scaled = rows[ids] if weights is None else rows[ids] * weights[:, None]
    bags = torch.repeat_interleave(torch.arange(len(lengths)), lengths.long())
    out = torch.zeros(len(lengths), rows.shape[1]).index_add_(0, bags, scaled)
    return out / lengths.clamp(min=1)[:, None].float() if mean else out


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> ``dtype`` as fbgemm's kernel converts its result: float16 round-to-nearest-even (torch's cast),
    bfloat16 by adding half a unit of the dropped 16 bits and truncating (ties away from zero; torch rounds ties
    to even, so the two differ on exact ties)."""
    if dtype == torch.bfloat16:
        return ((x.view(torch.int32) + 0x8000) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return x.to(dtype)


def _ebc(weighted: bool) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=20, feature_names=["f1"]),
              EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=20, feature_names=["f2"], pooling=PoolingType.MEAN),
              EmbeddingBagConfig(name="t3", embedding_dim=32, num_embeddings=20, feature_names=["f3", "f4"])]
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.FP16])
def test_pooled_half_and_bfloat16_outputs_are_the_float32_pooling_cast_once(data_type, weighted):
    ebc = _ebc(weighted)
    kjt = _kjt(["f1", "f2", "f3", "f4"], weighted=weighted)
    ebc.qconfig = _qconfig(torch.float, WEIGHT[data_type])
    q32 = qem.EmbeddingBagCollection.from_float(ebc)
    want32 = q32(kjt)
    # the float32 module against plain torch over its decoded rows
    per_feature = kjt.to_dict()
    stored = q32.table_weights()
    for t in ebc.embedding_bag_configs():
        rows = _decoded(*stored[t.name], data_type, t.embedding_dim)
        for f in t.feature_names:
            jt = per_feature[f]
            ref = _pooled(rows, jt.values(), jt.lengths(), jt.weights() if weighted else None, t.pooling == PoolingType.MEAN)
            torch.testing.assert_close(want32[f], ref, atol=2e-6, rtol=1e-6)
    assert q32.output_dtype() == torch.float32 and want32.values().dtype == torch.float32
    for output in (torch.float16, torch.bfloat16):
        ebc.qconfig = _qconfig(output, WEIGHT[data_type])
        q = qem.EmbeddingBagCollection.from_float(ebc)
        got = q(kjt)
        assert q.output_dtype() == output and got.values().dtype == output
        assert got.keys() == want32.keys() and got.length_per_key() == want32.length_per_key()
        assert torch.equal(got.values(), _cast(want32.values(), output))
        # the same rows: only the result's dtype differs
        assert all(torch.equal(a[0], b[0]) for a, b in zip(q.table_weights().values(), stored.values()))


def test_unpooled_half_output_is_the_float32_rows_cast():
    torch.manual_seed(1)
    tables = [EmbeddingConfig(name="e1", embedding_dim=16, num_embeddings=20, feature_names=["f1", "f2"]),
              EmbeddingConfig(name="e2", embedding_dim=8, num_embeddings=20, feature_names=["f3"])]
    ec = EmbeddingCollection(tables=tables)
    kjt = _kjt(["f1", "f2", "f3"])
    ec.qconfig = _qconfig(torch.float, torch.qint8)
    want = qem.EmbeddingCollection.from_float(ec)(kjt)
    ec.qconfig = _qconfig(torch.half, torch.qint8)
    q = qem.EmbeddingCollection.from_float(ec)
    got = q(kjt)
    assert q.output_dtype() == torch.float16
    for f in ("f1", "f2", "f3"):
        assert got[f].values().dtype == torch.float16
        assert torch.equal(got[f].values(), want[f].values().half())
        assert torch.equal(got[f].lengths(), want[f].lengths())


def test_the_constructors_and_a_meta_collection_take_the_output_dtype():
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=10, feature_names=["f1"], data_type=DataType.INT8)]
    kjt = _kjt(["f1"], high=10)
    built = qem.EmbeddingBagCollection(tables, False, "cpu", output_dtype=torch.half)
    assert built(kjt).values().dtype == torch.float16
    # TorchRec's meta_to_cpu test: a collection on meta quantizes to a CPU twin (rows zero) answering in half
    meta = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=10, feature_names=["f1"])],
                                  device=torch.device("meta"))
    meta.qconfig = _qconfig(torch.half, torch.qint8)
    twin = qem.EmbeddingBagCollection.from_float(meta)
    out = twin(kjt).values()
    assert out.dtype == torch.float16 and twin.device.type == "cpu" and not out.any()
    for bad in (torch.int8, torch.float64):
        with pytest.raises(ValueError, match=rf"output_dtype {bad}: the quantized collections output one of"):
            qem.EmbeddingBagCollection(tables, False, "cpu", output_dtype=bad)
    with pytest.raises(ValueError, match=r"activation dtype torch.int8"):
        QuantConfig(activation=quant.PlaceholderObserver.with_args(dtype=torch.int8))
    assert QuantConfig().output_dtype == torch.float32
    assert QuantConfig(activation=quant.PlaceholderObserver.with_args(dtype=torch.bfloat16)).output_dtype == torch.bfloat16


def test_export_serving_and_inference_sharding_take_float32_collections_only():
    ebc = _ebc(False)
    ebc.qconfig = _qconfig(torch.half, torch.qint8)
    q = qem.EmbeddingBagCollection.from_float(ebc)
    with pytest.raises(ValueError, match=r"^the flat lookup \(export, serving\) takes quantized collections that output "
                                         r"float32; this one outputs torch.float16"):
        FlatPooledLookup.of(q)
    with pytest.raises(ValueError, match="^inference sharding takes quantized collections that output float32"):
        shard_quant_model(torch.nn.Sequential(q), shards=2)
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="e", embedding_dim=8, num_embeddings=10, feature_names=["f"])])
    ec.qconfig = _qconfig(torch.bfloat16, torch.qint8)
    with pytest.raises(ValueError, match="this one outputs torch.bfloat16"):
        FlatEmbeddingCollection.of(qem.EmbeddingCollection.from_float(ec))
    # float32 collections go on as before
    ebc.qconfig = _qconfig(torch.float, torch.qint8)
    FlatPooledLookup.of(qem.EmbeddingBagCollection.from_float(ebc))
