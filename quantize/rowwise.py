"""Row-wise quantization of float tables into the row formats fbgemm's inference TBE reads.

INT8 / INT4 / INT2 rows are asymmetric: ``x ~ q * scale + bias`` with one fp16 scale
and one fp16 bias per row and q in [0, 2^bits - 1]; q values are packed low bits
first (two per byte for INT4, four for INT2). In the TBE the row is laid out as
``[scale fp16 | bias fp16 | packed q]`` (``split_embedding_weights`` returns the
packed data and the 4-byte scale/bias separately). FP16 and FP32 rows are the
values themselves; FP8 uses fbgemm's own hfp8 conversion. fbgemm's operators
(``torch.ops.fbgemm.*``) load fbgemm_gpu on first use, as everywhere in recship (recship/fbgemm.py).

The min/max choice (scale = (max - min) / (2^bits - 1), bias = min, both rounded
to fp16 first) is bit-identical to fbgemm's FloatToFusedNBitRowwiseQuantizedSBHalf;
at 8 bits recship's own kernel (quantize/row_kernels.py) gives the same bytes faster.
The error-minimising choice searches clipping ranges per row and keeps min/max
wherever nothing beats it, so no row gets worse. It evaluates a clipping only where a
bound on its error does not already rule it out (on ordinary INT8 rows, everywhere:
only rows of tiny range, where the fp16 scale or bias is coarse, can gain). The row kernel
makes the same choice in one pass per row; rows whose choice a float sum's order could
turn are searched by torch as before.

Everything works on row chunks (``chunk_rows``) so a table of any size is
quantized with bounded extra memory, and all offsets are 64-bit.
"""

import contextlib
import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from recship.modules.types import DataType
from recship.quantize import row_kernels

# Fractions of a row's range clipped from the bottom and from the top; (0, 0) is min/max.
_CLIP_GRID = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)

# Rows the error-minimising search handles at a time (and one worker's unit): its [rows, dim]
# temporaries stay in cache. 8192 was the fastest of 2048-32768 at dim 64; the old search ran
# about 2x slower on 65536-row chunks than on 8192-row ones.
_SEARCH_ROWS = 8192

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


def _fbgemm_layout(rows: int, dim: int, bits: int) -> bool:
    """Whether fbgemm's fused row-wise ops (``[packed | fp16 scale | fp16 bias]``) take rows of ``dim``
    values at ``bits``: a non-empty chunk whose rows pack into whole, even byte counts (they refuse
    e.g. INT2 at dim 12 or INT4 at dim 3). Their bytes and floats equal this module's
    (tests/quantize/test_rowwise.py)."""
    return rows > 0 and (dim * bits) % 16 == 0


def _best_range(w: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``w`` [rows, dim] float32, the (scale, bias) [rows] float32 among the clipping grid with the least squared error.

    The choice is the one of trying every candidate on every row in order (min/max first, a
    candidate replacing the best only if strictly better), bit for bit; but rows are searched
    ``_SEARCH_ROWS`` at a time (the temporaries stay in cache) and a candidate is evaluated
    only on rows where a lower bound on its error does not already reach min/max's.
    """
    scale, bias = torch.empty_like(w[:, 0]), torch.empty_like(w[:, 0])
    fast = row_kernels.available() and w.shape[1] <= row_kernels.SEARCH_MAX_DIM

    def search(block: Tuple[int, int]) -> None:
        start, end = block
        if fast:
            scale[start:end], bias[start:end] = _search_block_fast(w[start:end], bits)
        else:
            scale[start:end], bias[start:end] = _search_block(w[start:end], bits)

    blocks = list(row_chunks(w.shape[0], _SEARCH_ROWS))
    workers = min(torch.get_num_threads(), len(blocks))
    if workers <= 1:
        for block in blocks:
            search(block)
    else:
        with single_threaded_pool(workers) as pool:
            list(pool.map(search, blocks))
    return scale, bias


@contextlib.contextmanager
def single_threaded_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of ``workers`` threads whose torch ops each run on one thread.

    The search is many small ops; split over intra-op threads, each op ends at a barrier,
    and on a machine shared with other work (2 cores, load 3) every barrier waits for a
    descheduled thread: 2 intra-op threads ran the search 5-10x slower than 1. Blocks on
    single-threaded workers never wait on each other. ``torch.set_num_threads`` sets the
    calling thread's OpenMP thread count and a process-wide default that threads started
    later copy; the default is restored when the pool is done.
    """
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="recship-search", initializer=torch.set_num_threads, initargs=(1,))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True)
        torch.set_num_threads(threads)


def _search_block_fast(w: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """_search_block's choice by the row kernel (quantize/row_kernels.py: every candidate of a row in one pass); the
    rows it leaves undecided (near ties a float sum's order could turn, NaN/inf, a zero min or max) by _search_block."""
    cut_lo, cut_hi = _clip_candidates()
    scale, bias, decided = row_kernels.search_range(_columns_contiguous(w), bits, cut_lo, cut_hi)
    left = (~decided).nonzero()[:, 0]
    if left.numel():
        # at least two rows, as every block _search_block sees (a lone row's sum may take another order)
        rows = left.repeat(2) if left.numel() == 1 else left
        found_scale, found_bias = _search_block(w.index_select(0, rows), bits)
        scale[left], bias[left] = found_scale[: left.numel()], found_bias[: left.numel()]
    return scale, bias


def _columns_contiguous(w: torch.Tensor) -> torch.Tensor:
    """``w`` [rows, dim] itself where each row's values are adjacent (the row kernels take any row stride), else a copy."""
    return w if w.stride(1) == 1 else w.contiguous()


def _search_block(w: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """_best_range on one block of rows [rows, dim]: every temporary is [rows, dim] or [rows, candidates]."""
    rows = w.shape[0]
    lo, hi = torch.aminmax(w, dim=1)  # one pass
    span = hi - lo
    scale0, bias0 = _qparams(lo, hi, bits)
    err0 = _sq_error(w, scale0, bias0, bits)
    cut_lo, cut_hi = _clip_candidates()
    # [rows, candidates], by the same float ops as one candidate at a time: the same values
    scales, biases = _qparams(lo[:, None] + cut_lo * span[:, None], hi[:, None] - cut_hi * span[:, None], bits)
    # Every code dequantizes (code * scale + bias, as _sq_error computes it) to a value between
    # the bias and the top code's value (scale < 0 where the bias rounded up past the row's
    # top), as float rounding is monotone. So if the row's min is below that interval its
    # computed squared error is >= fl(floor - min)^2, likewise for the max, and a float sum
    # of non-negative terms is >= the float sum of some of them: ``bound`` (with a margin for
    # the order of summation) cannot exceed the candidate's computed error. A candidate whose
    # error is >= min/max's is never chosen, so it is evaluated only where the bound is below.
    tops = scales * (2**bits - 1) + biases
    floor, ceil = torch.minimum(biases, tops), torch.maximum(biases, tops)
    bound = (floor - lo[:, None]).clamp_(min=0).square_().double()
    bound += (hi[:, None] - ceil).clamp_(min=0).square_()
    todo = ~(bound * (1 - 2**-16) >= err0[:, None])  # NaN rows stay to do: they keep min/max below
    err = torch.full((rows, cut_lo.numel()), float("inf"))
    # a candidate most rows need is evaluated on every row (errors where it was ruled out are
    # right too); the others on the (row, candidate) pairs left, gathered
    dense = todo.sum(dim=0) > rows // 2
    for c in dense.nonzero()[:, 0].tolist():
        err[:, c] = _sq_error(w, scales[:, c], biases[:, c], bits)
    which = (todo & ~dense).nonzero()
    for start, end in row_chunks(which.shape[0], _SEARCH_ROWS):
        row, cand = which[start:end, 0], which[start:end, 1]
        if end - start == 1 and rows > 1:
            # torch sums a lone row of >= 32768 values on several threads, in another order
            # than each row of a [rows, dim] tensor: sum it as one of two, like min/max's
            row, cand = row.repeat(2), cand.repeat(2)
        err[row, cand] = _sq_error(w.index_select(0, row), scales[row, cand], biases[row, cand], bits)
    # The first least error, min/max winning ties: the sequential strict "<" of trying every
    # candidate in order. A NaN error is never less than anything; a NaN min/max error is
    # never beaten.
    better, best = err.nan_to_num(nan=float("inf")).min(dim=1)
    keep = ~(better < err0)
    pick = best[:, None]
    return (
        torch.where(keep, scale0, scales.gather(1, pick)[:, 0]),
        torch.where(keep, bias0, biases.gather(1, pick)[:, 0]),
    )


@functools.lru_cache(maxsize=None)
def _clip_candidates() -> Tuple[torch.Tensor, torch.Tensor]:
    """The clipping grid in search order, (0, 0) left out: fractions cut from the bottom and top, [candidates] float32 each."""
    pairs = [(a, b) for a in _CLIP_GRID for b in _CLIP_GRID if not (a == 0.0 and b == 0.0 or a + b >= 0.9)]
    return torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs])


def _sq_error(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row of ``w`` [rows, dim], the squared error [rows] of quantizing it with (scale, bias) [rows].

    The float ops of ``((_codes(w, ...) * scale + bias - w) ** 2).sum(1)`` one by one (x ** 2
    is x * x in torch), in place: the same values with one temporary.
    """
    d = w - bias[:, None]
    d.mul_((1.0 / scale)[:, None]).round_().clamp_(0, 2**bits - 1)
    d.mul_(scale[:, None]).add_(bias[:, None]).sub_(w)
    return d.mul_(d).sum(dim=1)


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
            lo, hi = torch.aminmax(w, dim=1)  # one pass over the rows
            # fbgemm's kernel gives the same bytes several times faster, except on rows with a NaN, an inf or a
            # span that overflows (its NaN bits differ): a chunk with such a row takes the torch path whole
            if _fbgemm_layout(w.shape[0], w.shape[1], bits) and bool(torch.isfinite(hi - lo).all()):
                if bits == 8 and row_kernels.available():  # the same bytes, faster (quantize/row_kernels.py)
                    data, scale_bias = w.new_empty(w.shape, dtype=torch.uint8), w.new_empty((w.shape[0], 4), dtype=torch.uint8)
                    if row_kernels.quantize_int8_into(_columns_contiguous(w), data, scale_bias) is not None:
                        return QuantizedRows(data, scale_bias)
                fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w.contiguous(), bits)  # [packed | scale | bias]
                return QuantizedRows(fused[:, :-4], fused[:, -4:])
            scale, bias = _qparams(lo, hi, bits)
        if row_kernels.available():  # the same bytes in one pass (quantize/row_kernels.py)
            packed = row_kernels.quantize_with(_columns_contiguous(w), bits, scale, bias)
            if packed is not None:
                return QuantizedRows(*packed)
        data = _pack(_codes(w, scale, bias, bits), bits)
        scale_bias = torch.stack([scale.half(), bias.half()], dim=1).view(torch.uint8)
        return QuantizedRows(data, scale_bias)
    if data_type == DataType.FP16:
        return QuantizedRows(w.half().view(torch.uint8), None)
    if data_type == DataType.FP32:
        return QuantizedRows(w.contiguous().view(torch.uint8), None)
    if data_type == DataType.FP8:
        max_pos = _fp8_max()
        return QuantizedRows(
            torch.ops.fbgemm.FloatToHFP8Quantized(w.contiguous(), FP8_EXPONENT_BITS, FP8_EXPONENT_BIAS, max_pos), None
        )
    raise ValueError(f"cannot quantize to {data_type.name}")


def quantize_measured(w: torch.Tensor, data_type: DataType, error_minimizing: bool = False) -> Tuple[QuantizedRows, float, float]:
    """``quantize_rows(w, ...)`` and the (max, sum) of |dequantized - w| over the chunk.

    Min/max rows in fbgemm's layout take its kernel without looking at the rows first: a row
    with a NaN, an inf or an overflowing span shows as a non-finite error, and only then is
    the chunk quantized again by ``quantize_rows`` (which routes it to the torch path).
    """
    w = w.detach().float()
    bits = data_type.bits if data_type in (DataType.INT8, DataType.INT4, DataType.INT2) else 0
    if bits and not error_minimizing and _fbgemm_layout(w.shape[0], w.shape[1], bits):
        fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w.contiguous(), bits)  # [packed | scale | bias]
        err = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, bits).sub_(w).abs_()
        worst = float(err.max())
        if math.isfinite(worst):
            return QuantizedRows(fused[:, :-4], fused[:, -4:]), worst, float(err.sum(dtype=torch.float64))
    q = quantize_rows(w, data_type, error_minimizing)
    values = dequantize_rows(q, data_type, w.shape[1])
    err = (values.sub_(w) if bits else values - w).abs_()  # FP32's values alias ``w``
    return q, float(err.max()) if err.numel() else 0.0, float(err.sum(dtype=torch.float64))


def quantize_measured_into(w: torch.Tensor, data_type: DataType, error_minimizing: bool, data: torch.Tensor,
                           scale_bias: Optional[torch.Tensor]) -> Tuple[float, float]:
    """``quantize_measured`` written into ``data`` [rows, packed bytes] and ``scale_bias`` [rows, 4] (uint8 views
    of a TBE's rows, any row stride; None for FP types); returns the (max, sum) of |dequantized - w|.

    Min/max INT8 rows in fbgemm's layout take the INT8 kernel where it runs (quantize/row_kernels.py: the same
    bytes as fbgemm's op, written in place, the error measured in the same pass). Where the error is not finite,
    the rows written are undefined (the caller refuses them).
    """
    w = w.detach().float()
    if (data_type == DataType.INT8 and not error_minimizing and scale_bias is not None and _fbgemm_layout(w.shape[0], w.shape[1], 8)
            and row_kernels.available()):
        measured = row_kernels.quantize_int8_into(_columns_contiguous(w), data, scale_bias)
        if measured is not None:
            return measured
    q, worst, total = quantize_measured(w, data_type, error_minimizing)
    if not math.isfinite(worst):
        return worst, total
    data.copy_(q.data)
    if (scale_bias is None) != (q.scale_bias is None):
        raise ValueError(f"{data_type.name} rows {'have' if q.scale_bias is not None else 'have no'} scale/bias, but the block "
                         f"{'has no' if scale_bias is None else 'has'} scale_bias storage (None for FP types)")
    if scale_bias is not None and q.scale_bias is not None:  # (both or neither, checked above)
        scale_bias.copy_(q.scale_bias)
    return worst, total


def _fp8_max() -> float:
    """Largest value of fbgemm's hfp8 with the exponent bits/bias used here."""
    mantissa_bits = 7 - FP8_EXPONENT_BITS
    return (2 - 2**-mantissa_bits) * 2.0 ** ((2**FP8_EXPONENT_BITS - 1) - FP8_EXPONENT_BIAS)


def dequantize_rows(rows: QuantizedRows, data_type: DataType, dim: int) -> torch.Tensor:
    """The float32 values a TBE reads from quantized rows (for error reports and tests)."""
    if data_type in (DataType.INT8, DataType.INT4, DataType.INT2):
        if rows.scale_bias is None:
            raise ValueError(f"{data_type.name} rows need their scale_bias; got QuantizedRows without one")
        if rows.data.shape[1] == (dim * data_type.bits + 7) // 8 and _fbgemm_layout(rows.data.shape[0], dim, data_type.bits):
            fused = torch.cat([rows.data, rows.scale_bias], dim=1)
            return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, data_type.bits)
        sb = rows.scale_bias.contiguous().view(torch.float16).float()
        codes = _unpack(rows.data, data_type.bits, dim).float()
        return codes * sb[:, 0:1] + sb[:, 1:2]
    if data_type == DataType.FP16:
        return rows.data.contiguous().view(torch.float16).float()
    if data_type == DataType.FP32:
        return rows.data.contiguous().view(torch.float32)
    if data_type == DataType.FP8:
        return torch.ops.fbgemm.HFP8QuantizedToFloat(rows.data.contiguous(), FP8_EXPONENT_BITS, FP8_EXPONENT_BIAS)
    raise ValueError(f"cannot dequantize {data_type.name}")


def row_chunks(num_rows: int, chunk_rows: int) -> Iterator[Tuple[int, int]]:
    """(start, end) row ranges of at most ``chunk_rows`` rows (Python ints: no 32-bit overflow)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    for start in range(0, num_rows, chunk_rows):
        yield start, min(num_rows, start + chunk_rows)
