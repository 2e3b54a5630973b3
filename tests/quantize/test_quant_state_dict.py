"""A quantized EmbeddingBagCollection's state_dict is TorchRec's QuantEmbeddingBagCollection's (tests/snippets/
torchrec_quant_state_dict.txt through docs/torchrec.md's import map): keys ``embedding_bags.<table>.weight`` only (TorchRec's
default: no split scale/bias, no registered TBEs), uint8 rows of TorchRec's layout (fp16 scale | fp16 bias | data,
padded to 16 bytes), strict loads both ways; rows loaded from TorchRec's layout, built here by hand, look up exactly
their dequantization in plain PyTorch."""

import copy
import io

import pytest
import torch
from torch import nn

from recship.sparse import KeyedJaggedTensor
from tutorials.notebook import run_snippet

ALIGN = 16  # TorchRec's row alignment (DEFAULT_ROW_ALIGNMENT)


@pytest.fixture(scope="module")
def user():
    return run_snippet("torchrec_quant_state_dict", forbid_torchrec=True)


def _row_bytes(dim: int, bits: int) -> int:
    """TorchRec's stored row: data (dim * bits / 8 bytes), plus 4 bytes of fp16 scale and bias for the integer
    types, rounded up to 16 bytes."""
    raw = dim * bits // 8 + (4 if bits < 16 else 0)
    return (raw + ALIGN - 1) // ALIGN * ALIGN


def _torchrec_layout(dims_rows, bits):
    """A module holding TorchRec's state_dict layout: embedding_bags.<table>.weight, [rows, row bytes] uint8."""
    m = nn.Module()
    m.embedding_bags = nn.ModuleDict()
    for name, (rows, dim) in dims_rows.items():
        m.embedding_bags[name] = nn.Module()
        m.embedding_bags[name].register_buffer("weight", torch.zeros(rows, _row_bytes(dim, bits), dtype=torch.uint8))
    return m


def _torchrec_rows(rows: int, dim: int, bits: int, g: torch.Generator):
    """Random rows in TorchRec's integer layout and their dequantization [rows, dim] (scale * q + bias)."""
    scale = (torch.rand(rows, generator=g) * 0.1 + 0.01).half()
    bias = (torch.rand(rows, generator=g) - 0.5).half()
    q = torch.randint(0, 2**bits, (rows, dim), generator=g, dtype=torch.uint8)
    if bits == 4:  # two ids a byte, the first in the low nibble
        data = q[:, 0::2] | (q[:, 1::2] << 4)
    else:
        data = q
    stored = torch.zeros(rows, _row_bytes(dim, bits), dtype=torch.uint8)
    stored[:, 0:2] = scale.view(torch.uint8).view(rows, 2)
    stored[:, 2:4] = bias.view(torch.uint8).view(rows, 2)
    stored[:, 4:4 + data.shape[1]] = data
    return stored, q.float() * scale.float().unsqueeze(1) + bias.float().unsqueeze(1)


def _kjt():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (2 * 5,), generator=g, dtype=torch.int32)
    n0 = int(lengths[:5].sum())
    values = torch.cat([torch.randint(0, 10, (n0,), generator=g), torch.randint(0, 6, (int(lengths.sum()) - n0,), generator=g)])
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)


def _pooled(table: torch.Tensor, kjt: KeyedJaggedTensor, key: str) -> torch.Tensor:
    jt = kjt[key]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), jt.lengths().long().cumsum(0)])
    return torch.nn.functional.embedding_bag(jt.values().long(), table, offsets[:-1], mode="sum")


@pytest.mark.parametrize("dtype,bits", [(torch.qint8, 8), (torch.quint4x2, 4), (torch.half, 16)])
def test_state_dict_keys_and_shapes_are_torchrecs_and_load_strictly_both_ways(user, dtype, bits):
    q = user["quantized_ebc"](user["tables"](), dtype)
    sd = q.state_dict()
    assert list(sd) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]  # no tbes.*, no qscale/qbias
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == {
        "embedding_bags.t0.weight": ((10, _row_bytes(8, bits)), torch.uint8),
        "embedding_bags.t1.weight": ((6, _row_bytes(16, bits)), torch.uint8)}
    # recship -> a module laid out as TorchRec's, strictly, bytes unchanged
    theirs = _torchrec_layout({"t0": (10, 8), "t1": (6, 16)}, bits)
    theirs.load_state_dict(sd, strict=True)
    assert all(torch.equal(theirs.state_dict()[k], v) for k, v in sd.items())
    # TorchRec's layout -> recship, strictly; the TBE's own buffers are still there for the kernel and TorchScript
    other = user["quantized_ebc"](user["tables"](), dtype, seed=1)
    other.load_state_dict(theirs.state_dict(), strict=True)
    assert torch.equal(other(_kjt()).values(), q(_kjt()).values())
    assert any(name.startswith("tbes.0.") for name, _ in other.named_buffers())


@pytest.mark.parametrize("dtype,bits", [(torch.qint8, 8), (torch.quint4x2, 4)])
def test_torchrec_rows_look_up_exactly_their_dequantization(user, dtype, bits):
    g = torch.Generator().manual_seed(bits)
    (r0, want0), (r1, want1) = _torchrec_rows(10, 8, bits, g), _torchrec_rows(6, 16, bits, g)
    q = user["quantized_ebc"](user["tables"](), dtype)
    q.load_state_dict({"embedding_bags.t0.weight": r0, "embedding_bags.t1.weight": r1}, strict=True)
    kjt = _kjt()
    got = q(kjt).to_dict()
    torch.testing.assert_close(got["f0"], _pooled(want0, kjt, "f0"), atol=1e-5, rtol=1e-5)  # sums in another order
    torch.testing.assert_close(got["f1"], _pooled(want1, kjt, "f1"), atol=1e-5, rtol=1e-5)
    # one id a bag: each row exactly (fbgemm computes scale * q + bias in fp32 as the reference does)
    ids = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.cat([torch.arange(10), torch.arange(6), torch.zeros(4, dtype=torch.long)]),
                            lengths=torch.ones(20, dtype=torch.int32))
    rows = q(ids).to_dict()
    assert torch.equal(rows["f0"], want0) and torch.equal(rows["f1"][:6], want1)
    # the loaded bytes are what state_dict gives back
    assert torch.equal(q.state_dict()["embedding_bags.t0.weight"], r0)
    # and they survive TorchScript save / load and deepcopy (the TBE buffers are non-persistent, not dropped)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(q), buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    assert torch.equal(loaded(kjt).values(), q(kjt).values())
    assert torch.equal(copy.deepcopy(q)(kjt).values(), q(kjt).values())


class _UInt4(torch.Tensor):
    """TorchRec's documented UInt4Tensor, the least of it: a uint8 wrapper shown as [rows, 2 * row bytes] values,
    whose ``.view(torch.uint8)`` is the bytes it wraps (torchrec.tensor_types)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, (elem.shape[0], 2 * elem.shape[1]), dtype=torch.uint8)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.view.dtype and args[1] == torch.uint8:
            return args[0].elem
        raise NotImplementedError(func)


def test_torchrecs_int4_tensors_load_as_their_bytes(user):
    g = torch.Generator().manual_seed(11)
    (r0, _), (r1, _) = _torchrec_rows(10, 8, 4, g), _torchrec_rows(6, 16, 4, g)
    theirs = {"embedding_bags.t0.weight": _UInt4(r0), "embedding_bags.t1.weight": _UInt4(r1)}
    assert tuple(theirs["embedding_bags.t0.weight"].shape) == (10, 2 * _row_bytes(8, 4))
    q = user["quantized_ebc"](user["tables"](), torch.quint4x2)
    q.load_state_dict(theirs, strict=True)
    assert torch.equal(q.state_dict()["embedding_bags.t0.weight"], r0) and torch.equal(q.state_dict()["embedding_bags.t1.weight"], r1)
    # int8 tables take no such wrapper: a wrong shape stays an error
    q8 = user["quantized_ebc"](user["tables"](), torch.qint8)
    with pytest.raises(RuntimeError, match="size mismatch"):
        q8.load_state_dict({"embedding_bags.t0.weight": _UInt4(torch.zeros(10, 16, dtype=torch.uint8)),
                            "embedding_bags.t1.weight": q8.state_dict()["embedding_bags.t1.weight"]})


def test_a_wrong_shape_or_extra_key_is_refused(user):
    q = user["quantized_ebc"](user["tables"](), torch.qint8)
    with pytest.raises(RuntimeError, match="size mismatch for embedding_bags.t0.weight"):
        q.load_state_dict({"embedding_bags.t0.weight": torch.zeros(10, 32, dtype=torch.uint8),
                           "embedding_bags.t1.weight": torch.zeros(6, 32, dtype=torch.uint8)})
    sd = dict(q.state_dict(), **{"tbes.0.D_offsets": torch.zeros(3, dtype=torch.int32)})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        q.load_state_dict(sd, strict=True)


def test_the_unpooled_module_has_torchrecs_keys_too():
    from recship.quantize import QuantConfig
    from recship.quantize.modules import quantize_embedding_collection
    from recship.trainer import EmbeddingCollection, EmbeddingConfig

    ec = EmbeddingCollection([EmbeddingConfig(name="e0", embedding_dim=8, num_embeddings=7, feature_names=["x"]),
                              EmbeddingConfig(name="e1", embedding_dim=8, num_embeddings=5, feature_names=["y"])])
    q, _ = quantize_embedding_collection(ec, QuantConfig(dtype="int8", row_alignment=ALIGN))
    assert {k: tuple(v.shape) for k, v in q.state_dict().items()} == {"embeddings.e0.weight": (7, _row_bytes(8, 8)),
                                                                       "embeddings.e1.weight": (5, _row_bytes(8, 8))}


@pytest.mark.parametrize("dtype,bits", [(torch.qint8, 8), (torch.quint4x2, 4)])
def test_split_scale_bias_is_torchrecs_layout(user, dtype, bits):
    """quant_prep_enable_quant_state_dict_split_scale_bias: weight is the packed data alone, [rows, dim * bits / 8]
    uint8, beside weight_qscale and weight_qbias [rows, 1] fp16; the same bytes as the unsplit rows."""
    split, whole = user["quantized_ebc_split"](user["tables"](), dtype), user["quantized_ebc"](user["tables"](), dtype)
    sd, rows = split.state_dict(), whole.state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == {
        f"embedding_bags.{t}.{n}": shape for t, (r, d) in {"t0": (10, 8), "t1": (6, 16)}.items()
        for n, shape in [("weight", ((r, d * bits // 8), torch.uint8)), ("weight_qscale", ((r, 1), torch.float16)),
                         ("weight_qbias", ((r, 1), torch.float16))]}
    for t, d in (("t0", 8), ("t1", 16)):
        stored = rows[f"embedding_bags.{t}.weight"]
        assert torch.equal(sd[f"embedding_bags.{t}.weight"], stored[:, 4:4 + d * bits // 8])
        assert torch.equal(sd[f"embedding_bags.{t}.weight_qscale"].view(torch.uint8), stored[:, 0:2])
        assert torch.equal(sd[f"embedding_bags.{t}.weight_qbias"].view(torch.uint8), stored[:, 2:4])
    # TorchRec's split layout built by hand loads strictly and looks up exactly its dequantization
    g = torch.Generator().manual_seed(20 + bits)
    (r0, want0), (r1, want1) = _torchrec_rows(10, 8, bits, g), _torchrec_rows(6, 16, bits, g)
    theirs = {}
    for t, stored, d in (("t0", r0, 8), ("t1", r1, 16)):
        theirs[f"embedding_bags.{t}.weight"] = stored[:, 4:4 + d * bits // 8].clone()
        theirs[f"embedding_bags.{t}.weight_qscale"] = stored[:, 0:2].contiguous().view(torch.float16)
        theirs[f"embedding_bags.{t}.weight_qbias"] = stored[:, 2:4].contiguous().view(torch.float16)
    split.load_state_dict(theirs, strict=True)
    ids = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.cat([torch.arange(10), torch.arange(6), torch.zeros(4, dtype=torch.long)]),
                            lengths=torch.ones(20, dtype=torch.int32))
    got = split(ids).to_dict()
    assert torch.equal(got["f0"], want0) and torch.equal(got["f1"][:6], want1)
    # float tables have no scale and bias to split
    fp16 = user["quantized_ebc_split"](user["tables"](), torch.half).state_dict()
    assert list(fp16) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]


def test_register_tbes_adds_the_tbes_own_buffers(user):
    """quant_prep_enable_register_tbes: the TBE's persistent buffers (those fbgemm's own state_dict holds) join the
    rows, under tbes.<i>."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
    from fbgemm_gpu.split_embedding_configs import SparseType

    q = user["quantized_model_with_tbes"](user["tables"](), torch.qint8)
    fresh = IntNBitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[("t0", 10, 8, SparseType.INT8, EmbeddingLocation.HOST), ("t1", 6, 16, SparseType.INT8, EmbeddingLocation.HOST)],
        device="cpu")
    want = ["ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"] + [f"ebc.tbes.0.{k}" for k in fresh.state_dict()]
    assert sorted(q.state_dict()) == sorted(want)
    plain = user["quantized_ebc"](user["tables"](), torch.qint8)
    assert not any(k.startswith("tbes.") for k in plain.state_dict())
