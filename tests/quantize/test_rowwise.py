"""Row formats against fbgemm's own quantizers and plain-torch references."""

import pytest
import torch

from recship.quantize import rowwise
from recship.quantize.rowwise import QuantizedRows, dequantize_rows, quantize_rows, row_bytes, row_chunks
from recship.trainer import DataType


def _weights(rows=300, dim=64, seed=0):
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.mark.parametrize("data_type, bits", [(DataType.INT8, 8), (DataType.INT4, 4), (DataType.INT2, 2)])
@pytest.mark.parametrize("dim", [8, 12, 64])
def test_min_max_nbit_is_bit_identical_to_fbgemm(data_type, bits, dim):
    """quantize_rows (fbgemm's kernel where it takes the layout) and recship's own torch path (used where it
    does not: INT2 at dim 12) against fbgemm's FloatToFusedNBitRowwiseQuantizedSBHalf, on ordinary, tiny-range,
    constant and huge rows."""
    import fbgemm_gpu  # noqa: F401

    w = torch.cat([_weights(dim=dim), _weights(rows=3, dim=dim) * 1e-5, torch.full((2, dim), 3.5), torch.zeros(2, dim),
                   _weights(rows=3, dim=dim) * 1e5])
    nbytes = (dim * bits + 7) // 8
    own = rowwise._pack(rowwise._codes(w, *rowwise._qparams(*torch.aminmax(w, dim=1), bits), bits), bits)
    q = quantize_rows(w, data_type)
    if nbytes % 2:  # fbgemm refuses an odd number of packed bytes: the torch path alone, against the formula's bounds
        assert torch.equal(q.data, own)
        return
    ref = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w, bits)  # [data | scale | bias]
    assert torch.equal(own, ref[:, :nbytes])
    assert torch.equal(q.data, ref[:, :nbytes])
    assert torch.equal(q.scale_bias, ref[:, nbytes:])  # TBE order: scale then bias (fp16 each)


@pytest.mark.parametrize("data_type, bits", [(DataType.INT8, 8), (DataType.INT4, 4), (DataType.INT2, 2)])
@pytest.mark.parametrize("dim", [8, 12, 64])
def test_dequantize_equals_codes_times_scale_plus_bias_bitwise(data_type, bits, dim):
    """dequantize_rows (fbgemm's kernel where it takes the layout) against the formula in plain torch."""
    w = _weights(dim=dim)
    q = quantize_rows(w, data_type, error_minimizing=True)
    sb = q.scale_bias.view(torch.float16).float()
    want = rowwise._unpack(q.data, bits, dim).float() * sb[:, 0:1] + sb[:, 1:2]
    assert torch.equal(dequantize_rows(q, data_type, dim), want)


def test_int8_codes_within_one_of_fbgemm_and_no_less_accurate():
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.tbe.utils import quantize_embs

    w = _weights()
    data, scale_bias = quantize_embs(w, SparseType.INT8)
    q = quantize_rows(w, DataType.INT8)
    # fbgemm rounds with fp32 qparams and stores them as fp16; recship rounds with the stored fp16 ones
    assert int((data.int() - q.data.int()).abs().max()) <= 1
    theirs = (dequantize_rows(QuantizedRows(data, scale_bias), DataType.INT8, 64) - w).norm()
    ours = (dequantize_rows(q, DataType.INT8, 64) - w).norm()
    assert ours <= theirs


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2])
def test_dequantize_matches_formula(data_type):
    w = _weights(rows=50, dim=12)  # dim not a multiple of the values per byte for int2/int4 padding paths
    q = quantize_rows(w, data_type)
    sb = q.scale_bias.view(torch.float16).float()
    step = sb[:, 0:1]
    deq = dequantize_rows(q, data_type, 12)
    # every value lands within half a step of the original (clamped to the row's range)
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    assert q.data.shape[1] + 4 == row_bytes(data_type, 12)


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2])
def test_error_minimizing_is_never_worse_on_any_row(data_type):
    w = _weights(rows=500)
    w[::7] *= 5  # a few rows with outliers, where clipping helps
    w[3, 5] = 3.0
    base = ((dequantize_rows(quantize_rows(w, data_type), data_type, 64) - w) ** 2).sum(1)
    best = ((dequantize_rows(quantize_rows(w, data_type, True), data_type, 64) - w) ** 2).sum(1)
    assert bool((best <= base + 1e-7).all())
    if data_type != DataType.INT8:
        assert float(best.sum()) < 0.95 * float(base.sum())


def test_float_formats_round_trip():
    w = _weights(rows=20)
    fp32 = dequantize_rows(quantize_rows(w, DataType.FP32), DataType.FP32, 64)
    fp16 = dequantize_rows(quantize_rows(w, DataType.FP16), DataType.FP16, 64)
    fp8 = dequantize_rows(quantize_rows(w, DataType.FP8), DataType.FP8, 64)
    assert torch.equal(fp32, w)
    assert torch.equal(fp16, w.half().float())
    # fbgemm hfp8 with 4 exponent bits, bias 7: 3 mantissa bits (relative step 2^-3, so
    # rounding error <= 2^-4 of the value) for normals >= 2^-6, absolute step 2^-9 below
    bound = torch.maximum(w.abs() * 2**-4, torch.full_like(w, 2**-10))
    assert bool(((fp8 - w).abs() <= bound * 1.0001).all())


def test_chunks_cover_rows_with_python_ints():
    assert list(row_chunks(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    big = list(row_chunks(3 * 2**31, 2**31))  # offsets past 2^31 stay exact
    assert big[-1] == (2 * 2**31, 3 * 2**31)
    with pytest.raises(ValueError, match="chunk_rows"):
        list(row_chunks(10, 0))
