"""Row-wise quantization of float tables into the row formats fbgemm's inference TBE reads.

INT8 / INT4 / INT2 rows are asymmetric: ``x ~ q * scale + bias`` with one fp16 scale
and one fp16 bias per row and q in [0, 2^bits - 1]; q values are packed low bits
first (two per byte for INT4, four for INT2). In the TBE the row is laid out as
``[scale fp16 | bias fp16 | packed q]`` (``split_embedding_weights`` returns the
packed data and the 4-byte scale/bias separately). FP16 and FP32 rows are the
values themselves; FP8 uses fbgemm's own hfp8 conversion.

The min/max choice (scale = (max - min) / (2^bits - 1), bias = min, both rounded
to fp16 first) is bit-identical to fbgemm's FloatToFusedNBitRowwiseQuantizedSBHalf.
The error-minimising choice searches clipping ranges per row and keeps min/max
wherever nothing beats it, so no row gets worse.

Everything works on row chunks (``chunk_rows``) so a table of any size is
quantized with bounded extra memory, and all offsets are 64-bit.
"""

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from recship.trainer.types import DataType

# Fractions of a row's range clipped from the bottom and from the top; (0, 0) is min/max.
_CLIP_GRID = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)

FP8_EXPONENT_BITS = 4
FP8_EXPONENT_BIAS = 7


def row_bytes(data_type: DataType, dim: int, alignment: int = 1) -> int:
    """Bytes of one stored row of ``dim`` values, padded to a multiple of ``alignment`` bytes."""
    if data_type in (DataType.INT8, DataType.INT4, DataType.INT2):
        n = (dim * data_type.bits + 7) // 8 + 4
    elif data_type == DataType.FP8:
        n = dim
    elif data_type == DataType.FP16:
        n = 2 * dim
    elif data_type == DataType.FP32:
        n = 4 * dim
    else:
        raise ValueError(f"{data_type.name} is not an inference weight type")
    return (n + alignment - 1) // alignment * alignment


@dataclass
class QuantizedRows:
    """A chunk of quantized rows: ``data`` [rows, packed bytes] uint8, ``scale_bias`` [rows, 4] uint8 or None."""

    data: torch.Tensor
    scale_bias: Optional[torch.Tensor]


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


def _unpack(data: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = [(data >> (i * bits)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=2).view(data.shape[0], -1)[:, :dim]


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


def dequantize_rows(rows: QuantizedRows, data_type: DataType, dim: int) -> torch.Tensor:
    """The float32 values a TBE reads from quantized rows (for error reports and tests)."""
    if data_type in (DataType.INT8, DataType.INT4, DataType.INT2):
        if rows.scale_bias is None:
            raise ValueError(f"{data_type.name} rows need their scale_bias; got QuantizedRows without one")
        sb = rows.scale_bias.contiguous().view(torch.float16).float()
        codes = _unpack(rows.data, data_type.bits, dim).float()
        return codes * sb[:, 0:1] + sb[:, 1:2]
    if data_type == DataType.FP16:
        return rows.data.contiguous().view(torch.float16).float()
    if data_type == DataType.FP32:
        return rows.data.contiguous().view(torch.float32)
    if data_type == DataType.FP8:
        import fbgemm_gpu  # noqa: F401

        return torch.ops.fbgemm.HFP8QuantizedToFloat(rows.data.contiguous(), FP8_EXPONENT_BITS, FP8_EXPONENT_BIAS)
    raise ValueError(f"cannot dequantize {data_type.name}")


def row_chunks(num_rows: int, chunk_rows: int) -> Iterator[Tuple[int, int]]:
    """(start, end) row ranges of at most ``chunk_rows`` rows (Python ints: no 32-bit overflow)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    for start in range(0, num_rows, chunk_rows):
        yield start, min(num_rows, start + chunk_rows)
