"""The quantize speed-ups change no quantized bit: quantize_rows against a frozen copy of the code before them.

Random tables with fixed seeds, including awkward rows (constant, huge outliers, zeros,
negative-only) and dims that are not multiples of the values per byte, for every
inference type with the error-minimising search on and off.
"""

from typing import Tuple

import pytest
import torch

from recship.quantize import rowwise
from recship.quantize.rowwise import QuantizedRows
from recship.modules.types import DataType

# ---------------------------------------------------------------------------
# The implementation before the speed-ups, kept as the bitwise reference.
# Copied verbatim from quantize/rowwise.py as of commit 2b91636; do not edit or speed it up.
# ---------------------------------------------------------------------------

# Fractions of a row's range clipped from the bottom and from the top; (0, 0) is min/max.
_CLIP_GRID = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)

FP8_EXPONENT_BITS = 4
FP8_EXPONENT_BIAS = 7


def _qparams(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp16-rounded (scale, bias) as float32, exactly as fbgemm computes them."""
    bias = lo.half().float()
    scale = ((hi - bias) / (2**bits - 1)).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale, bias


def _codes(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> torch.Tensor:
    inv = 1.0 / scale
    return torch.round((w - bias[:, None]) * inv[:, None]).clamp_(0, 2**bits - 1)


def _best_range(w: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row, the (scale, bias) among the clipping grid with the least squared error."""
    lo, hi = w.min(dim=1).values, w.max(dim=1).values
    span = hi - lo
    best_scale, best_bias = _qparams(lo, hi, bits)
    best_err = _sq_error(w, best_scale, best_bias, bits)
    for a in _CLIP_GRID:
        for b in _CLIP_GRID:
            if a == 0.0 and b == 0.0 or a + b >= 0.9:
                continue
            scale, bias = _qparams(lo + a * span, hi - b * span, bits)
            err = _sq_error(w, scale, bias, bits)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_bias = torch.where(better, bias, best_bias)
    return best_scale, best_bias


def _sq_error(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> torch.Tensor:
    deq = _codes(w, scale, bias, bits) * scale[:, None] + bias[:, None]
    return ((deq - w) ** 2).sum(dim=1)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, dim] codes -> [rows, ceil(dim * bits / 8)] bytes, low bits first."""
    per_byte = 8 // bits
    rows, dim = codes.shape
    padded = -dim % per_byte
    q = codes.to(torch.uint8)
    if padded:
        q = torch.cat([q, q.new_zeros(rows, padded)], dim=1)
    q = q.view(rows, -1, per_byte)
    out = q[:, :, 0].clone()
    for i in range(1, per_byte):
        out |= q[:, :, i] << (i * bits)
    return out


def quantize_rows(w: torch.Tensor, data_type: DataType, error_minimizing: bool = False) -> QuantizedRows:
    """Quantizes float rows [rows, dim] (one chunk) into ``data_type``'s TBE row format."""
    w = w.detach().float()
    if data_type in (DataType.INT8, DataType.INT4, DataType.INT2):
        bits = data_type.bits
        if error_minimizing:
            scale, bias = _best_range(w, bits)
        else:
            scale, bias = _qparams(w.min(dim=1).values, w.max(dim=1).values, bits)
        data = _pack(_codes(w, scale, bias, bits), bits)
        scale_bias = torch.stack([scale.half(), bias.half()], dim=1).view(torch.uint8)
        return QuantizedRows(data, scale_bias)
    if data_type == DataType.FP16:
        return QuantizedRows(w.half().view(torch.uint8), None)
    if data_type == DataType.FP32:
        return QuantizedRows(w.contiguous().view(torch.uint8), None)
    if data_type == DataType.FP8:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        max_pos = _fp8_max()
        return QuantizedRows(
            torch.ops.fbgemm.FloatToHFP8Quantized(w.contiguous(), FP8_EXPONENT_BITS, FP8_EXPONENT_BIAS, max_pos), None
        )
    raise ValueError(f"cannot quantize to {data_type.name}")


def _fp8_max() -> float:
    """Largest value of fbgemm's hfp8 with the exponent bits/bias used here."""
    mantissa_bits = 7 - FP8_EXPONENT_BITS
    return (2 - 2**-mantissa_bits) * 2.0 ** ((2**FP8_EXPONENT_BITS - 1) - FP8_EXPONENT_BIAS)


# ---------------------------------------------------------------------------
# end of the reference
# ---------------------------------------------------------------------------


TYPES = [DataType.INT8, DataType.INT4, DataType.INT2, DataType.FP8, DataType.FP16, DataType.FP32]


def _table(rows: int, dim: int, seed: int) -> torch.Tensor:
    """[rows, dim] float32: N(0, 0.05) rows with every 11th row made awkward in one of several ways."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * 0.05
    awkward = [
        lambda r: torch.full_like(r, 0.3),  # constant: span 0, scale replaced by 1
        lambda r: torch.zeros_like(r),
        lambda r: -r.abs() - 1.0,  # negative only
        lambda r: r.index_fill(0, torch.tensor([dim // 2]), 50.0),  # one huge outlier
        lambda r: r * 20.0,  # wide range
        lambda r: r + 1000.3,  # range tiny next to the offset: fp16 rounds the bias by more than a step
        lambda r: r * 1e-5,  # range so small the fp16 scale is subnormal
        lambda r: torch.rand(dim, generator=g) * 2 - 1,  # uniform
        lambda r: torch.randn(dim, generator=g) / torch.rand(dim, generator=g).clamp(min=0.01) * 0.05,  # heavy-tailed
        lambda r: r * torch.rand(1, generator=g) * 3,  # trained-like: rows of very different norms
        lambda r: -torch.zeros_like(r),  # -0.0
    ]
    for i in range(0, rows, 11):
        w[i] = awkward[(i // 11) % len(awkward)](w[i])
    return w


def _assert_same(got: QuantizedRows, want: QuantizedRows) -> None:
    assert got.data.dtype == want.data.dtype and torch.equal(got.data, want.data)
    if want.scale_bias is None:
        assert got.scale_bias is None
    else:
        assert got.scale_bias is not None and torch.equal(got.scale_bias, want.scale_bias)


@pytest.mark.parametrize("dim", [3, 12, 64, 66, 128])
@pytest.mark.parametrize("error_minimizing", [False, True])
@pytest.mark.parametrize("data_type", TYPES, ids=lambda t: t.name)
def test_bitwise_same_as_before(data_type, error_minimizing, dim, monkeypatch):
    # small search blocks: rows and (row, candidate) pairs span several blocks and pieces
    monkeypatch.setattr(rowwise, "_SEARCH_ROWS", 97)
    w = _table(600, dim, seed=dim)
    _assert_same(rowwise.quantize_rows(w, data_type, error_minimizing), quantize_rows(w, data_type, error_minimizing))


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2], ids=lambda t: t.name)
def test_bitwise_same_as_before_across_default_blocks(data_type):
    w = _table(rowwise._SEARCH_ROWS + 1000, 12, seed=1)
    _assert_same(rowwise.quantize_rows(w, data_type, True), quantize_rows(w, data_type, True))


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2], ids=lambda t: t.name)
def test_bitwise_same_as_before_on_column_blocks(data_type, monkeypatch):
    # column-wise shards quantize views [rows, cols] of a wider table (rows not contiguous)
    monkeypatch.setattr(rowwise, "_SEARCH_ROWS", 97)
    w = _table(400, 96, seed=4)[:, 32:80]
    assert not w.is_contiguous()
    _assert_same(rowwise.quantize_rows(w, data_type, True), quantize_rows(w, data_type, True))


@pytest.mark.parametrize("data_type", [DataType.INT4, DataType.INT2], ids=lambda t: t.name)
def test_bitwise_same_as_before_with_very_long_rows(data_type):
    # >= 32768 values a row: torch splits a lone row's sum over threads (in another order than
    # a row of a [rows, dim] tensor); the search sums a lone (row, candidate) pair as one of two
    w = _table(3, 40000, seed=5)
    _assert_same(rowwise.quantize_rows(w, data_type, True), quantize_rows(w, data_type, True))


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2], ids=lambda t: t.name)
def test_bitwise_same_as_before_with_nan_and_inf(data_type):
    w = _table(200, 16, seed=2)
    w[5, 3] = float("nan")
    w[17] = float("nan")
    w[29, 0] = float("inf")
    w[41, 2] = -float("inf")
    w[53] = float("inf")
    w[65, :8] = 3e38  # the span overflows
    w[65, 8:] = -3e38
    for error_minimizing in (False, True):
        _assert_same(rowwise.quantize_rows(w, data_type, error_minimizing), quantize_rows(w, data_type, error_minimizing))


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2], ids=lambda t: t.name)
def test_the_search_changes_rows_so_parity_means_something(data_type):
    # INT8 too: its search cannot be skipped outright. Rows whose range is so small that the
    # fp16 scale is subnormal (or tiny next to their offset, so the fp16 bias is off by more
    # than a step) do better clipped; on ordinary rows the bound rules every candidate out.
    w = _table(2000, 64, seed=3)
    plain, searched = quantize_rows(w, data_type, False), quantize_rows(w, data_type, True)
    changed = (plain.scale_bias != searched.scale_bias).any(dim=1)
    ordinary = torch.ones(w.shape[0], dtype=torch.bool)
    ordinary[::11] = False
    if data_type == DataType.INT8:
        assert int(changed.sum()) > 0 and int(changed[ordinary].sum()) == 0
    else:
        assert float(changed[ordinary].float().mean()) > 0.5
