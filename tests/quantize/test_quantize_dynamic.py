"""TorchRec's quantization entry point on recship: QuantConfig(activation=, weight=) + torch's quantize_dynamic.

References are computed here in plain torch: the registered ``embedding_bags.<table>.weight``
rows are decoded byte by byte ([fp16 scale | fp16 bias | packed codes] or fp16 values) and
pooled with ``F.embedding_bag``.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import quantization as quant

import recship
from recship import QuantConfig
from recship.quantize import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    quantize_embedding_bag_collection,
    quantize_embedding_collection,
    quantize_embeddings,
)
from recship.quantize import embedding_modules
from recship.sparse import KeyedJaggedTensor
from recship.trainer import DataType, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType

from reference import InferenceModule, tables_kjt

OBSERVED = {"int8": torch.int8, "int4": torch.quint4x2, "int2": torch.quint2x4, "fp16": torch.half}



def _qconfig(observed, **kw):
    return QuantConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
        weight=quant.PlaceholderObserver.with_args(dtype=observed),
        **kw,
    )


def _quantize(module, qconfig, float_type=EmbeddingBagCollection, quant_type=embedding_modules.EmbeddingBagCollection):
    return quant.quantize_dynamic(module, qconfig_spec={float_type: qconfig}, mapping={float_type: quant_type}, inplace=False)


def _ebc(seed=0):
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=150, embedding_dim=64, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", num_embeddings=90, embedding_dim=32, feature_names=["f1", "f2"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t2", num_embeddings=70, embedding_dim=16, feature_names=["f3"]),
    ]
    ebc = EmbeddingBagCollection(tables)
    with torch.no_grad():
        for t in tables:
            ebc.embedding_bags[t.name].weight.normal_(0, 0.1)
    return ebc


def _decode(stored: torch.Tensor, data_type: str, dim: int) -> torch.Tensor:
    """[rows, row bytes] uint8 as fbgemm's inference kernel lays them out -> [rows, dim] float32."""
    if data_type == "fp16":
        return stored[:, : 2 * dim].contiguous().view(torch.float16).float()
    bits = {"int8": 8, "int4": 4, "int2": 2}[data_type]
    scale = stored[:, 0:2].contiguous().view(torch.float16).float()
    bias = stored[:, 2:4].contiguous().view(torch.float16).float()
    per_byte = 8 // bits
    packed = stored[:, 4 : 4 + (dim * bits + 7) // 8].long()
    codes = torch.stack([(packed >> (bits * k)) & ((1 << bits) - 1) for k in range(per_byte)], dim=2).reshape(len(stored), -1)
    return codes[:, :dim].float() * scale + bias


def _pooled_reference(tables, decoded, kjt):
    """The pooled lookups of ``kjt`` over the decoded tables, in plain torch."""
    per_feature = kjt.to_dict()
    out = []
    for t in tables:
        for f in t.feature_names:
            jt = per_feature[f]
            mode = "mean" if t.pooling == PoolingType.MEAN else "sum"
            out.append(F.embedding_bag(jt.values(), decoded[t.name], jt.offsets()[:-1], mode=mode))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("data_type", ["int8", "int4", "int2", "fp16"])
def test_quantize_dynamic_equals_recships_quantizer_and_a_plain_torch_reference(data_type):
    ebc = _ebc()
    module = InferenceModule(ebc)
    q = _quantize(module, _qconfig(OBSERVED[data_type]))
    assert type(q.ebc_) is QuantEmbeddingBagCollection and type(module.ebc_) is EmbeddingBagCollection  # not in place
    tables = ebc.embedding_bag_configs()
    assert q.ebc_.weight_types() == {t.name: DataType[data_type.upper()] for t in tables}
    kjt = tables_kjt(tables, 6, seed=1, max_len=5)
    got = q(kjt)
    assert got.keys() == ["f0", "f1", "f2", "f3"] and got.values().dtype == torch.float32

    own, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype=data_type))
    assert torch.equal(got.values(), own(kjt).values())
    for name, (data, scale_bias) in own.table_weights().items():
        stored = q.ebc_.embedding_bags[name].weight
        width = data.shape[1] + (0 if scale_bias is None else 4)
        expected = data if scale_bias is None else torch.cat([scale_bias, data], dim=1)
        assert torch.equal(stored[:, :width], expected)  # the same bytes, only padded to 16

    buffers = dict(q.named_buffers())
    decoded = {t.name: _decode(buffers[f"ebc_.embedding_bags.{t.name}.weight"], data_type, t.embedding_dim) for t in tables}
    torch.testing.assert_close(got.values(), _pooled_reference(tables, decoded, kjt), atol=1e-5, rtol=1e-5)
    # the decoded rows are the float rows up to quantization error (measured: 0.005, 0.08, 0.32, 2e-4)
    bound = {"int8": 0.01, "int4": 0.12, "int2": 0.45, "fp16": 5e-4}[data_type]
    for t in tables:
        w = ebc.embedding_bags[t.name].weight.detach()
        assert float((decoded[t.name] - w).norm() / w.norm()) < bound


def test_buffers_are_torchrecs_per_table_rows_and_the_only_copy():
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=64, num_embeddings=4096, feature_names=[f])
        for n, f in (("product_table", "product"), ("user_table", "user"))
    ]
    ebc = EmbeddingBagCollection(tables)
    for data_type, width in (("int8", 80), ("int4", 48), ("fp16", 128)):
        q = _quantize(InferenceModule(ebc), _qconfig(OBSERVED[data_type]))
        weights = {n: (b.shape, b.dtype) for n, b in q.named_buffers() if n.endswith(".weight")}
        assert weights == {f"ebc_.embedding_bags.{t.name}.weight": (torch.Size([4096, width]), torch.uint8) for t in tables}
    # TorchRec's CPU alignment is 16; QuantConfig(row_alignment=1) stores the unpadded 68-byte rows
    q1 = _quantize(InferenceModule(ebc), _qconfig(torch.int8, row_alignment=1))
    assert q1.ebc_.embedding_bags["user_table"].weight.shape == (4096, 68)

    q = _quantize(InferenceModule(ebc), _qconfig(torch.int8))
    state = q.state_dict()
    assert not any(re.search(r"weights_\d+$", k) for k in state)  # no whole-TBE alias besides the per-table rows
    big = sorted(k for k, v in state.items() if v.numel() >= 4096)
    assert big == ["ebc_.embedding_bags.product_table.weight", "ebc_.embedding_bags.user_table.weight"]
    # the buffers are views of the TBE's storage: writing one changes what the kernel reads
    kjt = KeyedJaggedTensor(keys=["product", "user"], values=torch.tensor([3, 3]), lengths=torch.tensor([1, 1]))
    row = q.ebc_.embedding_bags["product_table"].weight[3]
    row[0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # scale 1
    row[2:4] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)  # bias 0.5
    row[4:68] = 2
    assert torch.equal(q(kjt).values()[0, :64], torch.full((64,), 2.5))


def test_state_dict_round_trip_through_the_per_table_buffers():
    ebc = _ebc()
    q = _quantize(InferenceModule(ebc), _qconfig(torch.quint4x2))
    other = _quantize(InferenceModule(_ebc(seed=5)), _qconfig(torch.quint4x2))
    kjt = tables_kjt(ebc.embedding_bag_configs(), 6, seed=1, max_len=5)
    assert not torch.equal(other(kjt).values(), q(kjt).values())
    other.load_state_dict(q.state_dict())
    assert torch.equal(other(kjt).values(), q(kjt).values())


def test_per_table_weight_dtype_spans_the_models_collections():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = _ebc()
            self.b = EmbeddingBagCollection([EmbeddingBagConfig(name="u0", num_embeddings=40, embedding_dim=8, feature_names=["g"])])

    qconfig = _qconfig(torch.int8, per_table_weight_dtype={"t1": torch.quint4x2, "u0": torch.half})
    assert qconfig.dtype == DataType.INT8 and qconfig.table_dtypes == {"t1": DataType.INT4, "u0": DataType.FP16}
    q = _quantize(Two(), qconfig)
    assert q.a.weight_types() == {"t0": DataType.INT8, "t1": DataType.INT4, "t2": DataType.INT8}
    assert q.b.weight_types() == {"u0": DataType.FP16}
    # recship's own entry point takes the same fields
    model, report = quantize_embeddings(Two(), per_table_weight_dtype={"t2": torch.quint2x4})
    assert model.a.weight_types()["t2"] == DataType.INT2 and model.b.weight_types() == {"u0": DataType.INT8}
    with pytest.raises(ValueError, match="names 'nope', which no collection has"):
        quantize_embeddings(Two(), per_table_weight_dtype={"nope": torch.half})


def test_embedding_collection_and_torch_qconfig():
    torch.manual_seed(0)
    tables = [EmbeddingConfig(name="e0", num_embeddings=50, embedding_dim=16, feature_names=["x"]),
              EmbeddingConfig(name="e1", num_embeddings=30, embedding_dim=8, feature_names=["y"])]
    ec = EmbeddingCollection(tables)
    q = _quantize(InferenceModule(ec), _qconfig(torch.int8), EmbeddingCollection, embedding_modules.EmbeddingCollection)
    assert type(q.ebc_) is QuantEmbeddingCollection
    assert {n: b.shape for n, b in q.named_buffers() if n.endswith(".weight")} == {
        "ebc_.embeddings.e0.weight": (50, 32), "ebc_.embeddings.e1.weight": (30, 16)}
    kjt = tables_kjt(tables, 6, seed=1, max_len=5)
    own, _ = quantize_embedding_collection(ec, QuantConfig(dtype="int8"))
    got, want = q(kjt), own(kjt)
    for f in ("x", "y"):
        assert torch.equal(got[f].values(), want[f].values())
    # torch's own QConfig namedtuple is read as QuantConfig(activation=, weight=)
    torch_qconfig = torch.ao.quantization.QConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float), weight=quant.PlaceholderObserver.with_args(dtype=torch.half))
    q16 = _quantize(InferenceModule(_ebc()), torch_qconfig)
    assert set(q16.ebc_.weight_types().values()) == {DataType.FP16}


def test_bad_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="observer dtype torch.int32"):
        _qconfig(torch.int32)
    with pytest.raises(ValueError, match="BF16 cannot be served"):
        _qconfig(torch.bfloat16)
    with pytest.raises(ValueError, match="activation dtype torch.int8"):
        QuantConfig(activation=quant.PlaceholderObserver.with_args(dtype=torch.int8), weight=quant.PlaceholderObserver.with_args(dtype=torch.int8))
    with pytest.raises(ValueError, match="dtype INT4 disagrees with the weight observer's INT8"):
        _qconfig(torch.int8, dtype="int4")
    with pytest.raises(ValueError, match="table 't1': table_dtypes says FP16, per_table_weight_dtype INT8"):
        _qconfig(torch.int8, table_dtypes={"t1": "fp16"}, per_table_weight_dtype={"t1": torch.qint8})
    with pytest.raises(ValueError, match="per_table_weight_dtype\\['t1'\\]"):
        _qconfig(torch.int8, per_table_weight_dtype={"t1": torch.uint8})
    with pytest.raises(TypeError, match="by keyword"):
        QuantConfig(quant.PlaceholderObserver.with_args(dtype=torch.float), quant.PlaceholderObserver.with_args(dtype=torch.int8))
    with pytest.raises(TypeError, match="observer factory"):
        QuantConfig(weight=torch.int8)
    # from_float checks what it is given
    ebc = _ebc()
    with pytest.raises(TypeError, match="must be a recship.QuantConfig"):
        QuantEmbeddingBagCollection.from_float(ebc)
    ebc.qconfig = _qconfig(torch.int8)
    with pytest.raises(TypeError, match="takes a float EmbeddingCollection, got EmbeddingBagCollection"):
        QuantEmbeddingCollection.from_float(ebc)
    assert QuantConfig().dtype == DataType.INT8 and recship.QuantConfig is QuantConfig
