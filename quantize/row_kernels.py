"""recship's row kernels (quantize/kernels/rowwise.c), vectorised with AVX2, each bit-equal to what it replaces:

- ``quantize_int8_into``: fbgemm's 8-bit rows with fp16 scale/bias, with the quantization error measured in the
  same pass. fbgemm's ``FloatToFusedNBitRowwiseQuantizedSBHalf`` at 8 bits computes its codes in a scalar loop
  (~2 GB/s per core here, against ~10 GB/s for its AVX2 INT4 path), and the error report needed a dequantize
  and a diff over the rows again. This kernel does both in one pass and writes straight into the TBE's row
  views (strided).
- ``quantize_with``: rows quantized with given (scale, bias) (``rowwise._codes`` and ``_pack``) in one pass.
- ``search_range``: the error-minimising search's choice of (scale, bias) (``rowwise._best_range``), all
  candidates of a row in one pass over it where torch made ~7 passes per candidate; the rows whose choice a
  float sum's order could change are left to the torch search.

The C file is compiled on first use (plain C, no torch headers: ~0.3 s) into ``cache_dir()``
(``~/.cache/recship/kernels``) under a name holding the hash of its source, compiler and flags (written by
an atomic rename: concurrent exports are safe), and loaded with ctypes, which releases the GIL during the
call: row blocks run on several threads. Where there is no C compiler (``$CC`` or ``cc``), or the CPU lacks
AVX2/F16C, ``available()`` is False and callers use fbgemm's op and the torch search (the same bytes, slower).
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "rowwise.c"
# -ffp-contract=off: fbgemm's codes and dequantized values are a separate mul and add (no FMA)
FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off", "-std=gnu11")


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$XDG_CACHE_HOME/recship/kernels``, else ``~/.cache/recship/kernels`` (read at
    each call: the environment may change between exports)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "recship" / "kernels"


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (cc or $CC): rows are quantized by fbgemm's op and torch (the same bytes, slower)")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\0".join((compiler,) + FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"rowwise-{key}.so"
    if not target.is_file():
        try:
            _compile(compiler, target)
        except (OSError, subprocess.CalledProcessError) as e:
            why = e.stderr.strip()[-500:] if isinstance(e, subprocess.CalledProcessError) else str(e)
            log.warning("compiling %s into %s failed (%s); rows are quantized by fbgemm's op and torch (the same bytes, slower)",
                        SOURCE, target, why)
            return None
    lib = ctypes.CDLL(str(target))
    if not lib.recship_int8_supported():
        log.info("this CPU lacks AVX2/F16C: rows are quantized by fbgemm's op and torch")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.recship_quantize_int8.restype = i64
    lib.recship_quantize_int8.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.POINTER(ctypes.c_float),
                                          ctypes.POINTER(ctypes.c_double)]
    lib.recship_quantize_with.restype = i64
    lib.recship_quantize_with.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr, i64, ptr, i64]
    lib.recship_search_range.restype = i64
    lib.recship_search_range.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, i64, ptr, ptr, ptr]
    return lib


def _compile(compiler: str, target: Path) -> None:
    """Compiles SOURCE into ``target`` through a temporary file beside it, renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def available() -> bool:
    """Whether the kernel runs here (compiled, or compiled now, and the CPU has AVX2 and F16C)."""
    return _library() is not None


def quantize_int8_into(w: torch.Tensor, data: torch.Tensor, scale_bias: torch.Tensor) -> Optional[Tuple[float, float]]:
    """Quantizes ``w`` [rows, dim] float32 (rows contiguous) into ``data`` [rows, dim] uint8 and ``scale_bias``
    [rows, 4] uint8 (fp16 scale, fp16 bias; each may be a view with any row stride, columns contiguous) as fbgemm's
    8-bit op does; returns (max, sum) of |dequantized - w|, or None where a row's error is not finite (a NaN or
    inf, or a range fp16 cannot hold: the rows written are then not fbgemm's). The kernel must be ``available()``."""
    lib = _library()
    assert lib is not None, "quantize_int8_into needs available()"
    rows, dim = w.shape
    if w.dtype != torch.float32 or w.stride(1) != 1 or data.dtype != torch.uint8 or scale_bias.dtype != torch.uint8:
        raise TypeError(f"quantize_int8_into takes float32 rows and uint8 outputs, got {w.dtype}, {data.dtype}, {scale_bias.dtype}")
    if data.shape != (rows, dim) or scale_bias.shape != (rows, 4) or data.stride(1) != 1 or scale_bias.stride(1) != 1:
        raise ValueError(f"quantize_int8_into: rows {tuple(w.shape)} need data [{rows}, {dim}] and scale_bias [{rows}, 4] "
                         f"with contiguous columns, got {tuple(data.shape)} stride {data.stride()} and "
                         f"{tuple(scale_bias.shape)} stride {scale_bias.stride()}")
    worst, total = ctypes.c_float(), ctypes.c_double()
    bad = lib.recship_quantize_int8(w.data_ptr(), rows, dim, w.stride(0), data.data_ptr(), data.stride(0),
                                    scale_bias.data_ptr(), scale_bias.stride(0), ctypes.byref(worst), ctypes.byref(total))
    return None if bad else (worst.value, total.value)


def quantize_with(w: torch.Tensor, bits: int, scale: torch.Tensor, bias: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Rows ``w`` [rows, dim] float32 (columns contiguous) quantized to ``bits`` (2, 4 or 8) with ``scale``, ``bias``
    [rows] float32 (fp16 values): (data [rows, ceil(dim * bits / 8)] uint8, scale_bias [rows, 4] uint8), as rowwise.py's
    ``_pack(_codes(...))`` and fp16 (scale, bias) give them; None where a code is not a number (a NaN or inf in a row,
    whose bytes rowwise.py decides). The kernel must be ``available()``."""
    lib = _library()
    assert lib is not None, "quantize_with needs available()"
    rows, dim = w.shape
    if bits not in (2, 4, 8):
        raise ValueError(f"quantize_with packs 2, 4 or 8 bits, got {bits}")
    if w.dtype != torch.float32 or w.stride(1) != 1 or scale.dtype != torch.float32 or bias.dtype != torch.float32:
        raise TypeError(f"quantize_with takes float32 rows with contiguous columns and float32 scale/bias, got {w.dtype} "
                        f"stride {w.stride()}, {scale.dtype}, {bias.dtype}")
    if scale.shape != (rows,) or bias.shape != (rows,):
        raise ValueError(f"quantize_with: {rows} rows need scale and bias [{rows}], got {tuple(scale.shape)} and {tuple(bias.shape)}")
    scale, bias = scale.contiguous(), bias.contiguous()
    data = torch.empty(rows, (dim * bits + 7) // 8, dtype=torch.uint8)
    scale_bias = torch.empty(rows, 4, dtype=torch.uint8)
    bad = lib.recship_quantize_with(w.data_ptr(), rows, dim, w.stride(0), bits, scale.data_ptr(), bias.data_ptr(), data.data_ptr(),
                                    data.stride(0), scale_bias.data_ptr(), scale_bias.stride(0))
    return None if bad else (data, scale_bias)


# the kernel's limits (its arrays; its error bound needs dim * 2^-24 small)
SEARCH_MAX_CANDIDATES = 63
SEARCH_MAX_DIM = 4096


def search_range(w: torch.Tensor, bits: int, cut_lo: torch.Tensor, cut_hi: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows ``w`` [rows, dim] float32 (rows contiguous, dim <= SEARCH_MAX_DIM) and the clipping grid ``cut_lo``,
    ``cut_hi`` [candidates] float32 (search order, min/max left out): (scale, bias, decided) [rows], float32, float32,
    bool: where ``decided``, the (scale, bias) ``rowwise._best_range`` chooses, bit for bit; elsewhere undefined
    (the torch search decides those rows). The kernel must be ``available()``."""
    lib = _library()
    assert lib is not None, "search_range needs available()"
    rows, dim = w.shape
    if w.dtype != torch.float32 or w.stride(1) != 1 or cut_lo.dtype != torch.float32 or cut_hi.dtype != torch.float32:
        raise TypeError(f"search_range takes float32 rows and cuts with contiguous columns, got {w.dtype} stride {w.stride()}, "
                        f"{cut_lo.dtype}, {cut_hi.dtype}")
    candidates = cut_lo.numel()
    if cut_hi.numel() != candidates or candidates > SEARCH_MAX_CANDIDATES or dim > SEARCH_MAX_DIM:
        raise ValueError(f"search_range: {candidates} and {cut_hi.numel()} cuts (at most {SEARCH_MAX_CANDIDATES}, as many of "
                         f"each) for rows of {dim} values (at most {SEARCH_MAX_DIM})")
    cut_lo, cut_hi = cut_lo.contiguous(), cut_hi.contiguous()
    scale, bias = torch.empty(rows), torch.empty(rows)
    decided = torch.empty(rows, dtype=torch.uint8)
    lib.recship_search_range(w.data_ptr(), rows, dim, w.stride(0), bits, cut_lo.data_ptr(), cut_hi.data_ptr(), candidates,
                             scale.data_ptr(), bias.data_ptr(), decided.data_ptr())
    return scale, bias, decided.bool()
