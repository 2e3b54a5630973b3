"""The INT8 row kernel (recship.quantize.int8_kernel) against fbgemm's FloatToFusedNBitRowwiseQuantizedSBHalf at
8 bits: the same bytes on every kind of row, and the error fbgemm's own dequantization gives."""

import math

import pytest
import torch

from recship.modules.types import DataType
from recship.quantize import int8_kernel
from recship.quantize.rowwise import quantize_measured, quantize_measured_into, quantize_rows

pytestmark = pytest.mark.skipif(not int8_kernel.available(), reason="no C compiler, or a CPU without AVX2/F16C")


def _rows(kind: str, rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    w = torch.randn(rows, dim, generator=g)
    if kind == "random":
        return w * torch.rand(rows, 1, generator=g) * 10
    if kind == "constant":
        return torch.randn(rows, 1, generator=g).expand(rows, dim).contiguous()
    if kind == "huge_range":  # spans up to 1.6e7 (a scale near fp16's top, 65504) and mins near fp16's bottom
        span = 10.0 ** (torch.rand(rows, 1, generator=g) * 7.2)
        w = torch.rand(rows, dim, generator=g) * span
        w[:, 0] = 0.0  # the min is the offset
        return torch.randint(-65000, 60000, (rows, 1), generator=g) + w
    if kind == "subnormal":  # float subnormals, and ranges whose scale is an fp16 subnormal or rounds to 0
        return w * 10.0 ** -torch.randint(4, 42, (rows, 1), generator=g).float()
    if kind == "negative_zero":  # the row's min is 0 held as -0.0 and +0.0 in various lanes: the bias's sign bit
        z = torch.zeros(rows, dim)
        z[torch.rand(rows, dim, generator=g) < 0.5] = -0.0
        z[: rows // 2] += torch.rand(rows // 2, dim, generator=g) * (torch.rand(rows // 2, dim, generator=g) < 0.3)
        return z
    if kind == "ties":  # values on the rounding boundary (x - bias) / scale = k + 0.5: round half to even
        scale = 2.0 ** torch.randint(-8, 4, (rows, 1), generator=g).float()
        codes = torch.randint(0, 255, (rows, dim), generator=g).float() + 0.5
        w = codes * scale
        w[:, 0], w[:, 1] = 0.0, 255 * scale[:, 0]  # min 0, max 255 * scale: the scale is exact
        return w
    raise AssertionError(kind)


KINDS = ["random", "constant", "huge_range", "subnormal", "negative_zero", "ties"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [64, 12, 130, 2])
def test_bytes_and_error_equal_fbgemm(kind, dim):
    g = torch.Generator().manual_seed(KINDS.index(kind) * 1000 + dim)
    w = _rows(kind, 517, dim, g)  # 517: a last group of 5 rows
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w, 8)
    err = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, 8).sub_(w).abs_()
    assert bool(torch.isfinite(err).all())
    # strided outputs, as a TBE's row views are: [scale_bias | data | padding] per row
    storage = torch.full((w.shape[0], dim + 4 + 3), 0xAB, dtype=torch.uint8)
    data, scale_bias = storage[:, 4 : 4 + dim], storage[:, :4]
    worst, total = int8_kernel.quantize_int8_into(w, data, scale_bias)
    assert torch.equal(data, fused[:, :-4]) and torch.equal(scale_bias, fused[:, -4:])
    assert bool((storage[:, 4 + dim :] == 0xAB).all())  # nothing written past a row
    assert worst == float(err.max())
    assert total == pytest.approx(float(err.sum(dtype=torch.float64)), rel=1e-12, abs=1e-300)


def test_rows_read_with_a_stride():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(300, 96, generator=g)
    w = wide[:, 16:80]  # rows 96 floats apart
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w.contiguous(), 8)
    data, scale_bias = torch.empty(300, 64, dtype=torch.uint8), torch.empty(300, 4, dtype=torch.uint8)
    int8_kernel.quantize_int8_into(w, data, scale_bias)
    assert torch.equal(data, fused[:, :-4]) and torch.equal(scale_bias, fused[:, -4:])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e38, -70000.0])
def test_a_row_that_cannot_be_stored_finite_is_reported(bad):
    # NaN/inf values, a span whose scale overflows fp16 (1e38), a min beyond fp16 (the bias is -inf)
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    w[17, 5] = bad
    data, scale_bias = torch.empty(40, 64, dtype=torch.uint8), torch.empty(40, 4, dtype=torch.uint8)
    assert int8_kernel.quantize_int8_into(w, data, scale_bias) is None
    # through quantize_measured_into the error is not finite, as quantize_measured's
    _, worst, _ = quantize_measured(w, DataType.INT8)
    assert not math.isfinite(worst)
    assert not math.isfinite(quantize_measured_into(w, DataType.INT8, False, data, scale_bias)[0])


def test_quantize_rows_and_measured_into_give_the_kernels_bytes():
    w = _rows("random", 1000, 64, torch.Generator().manual_seed(5))
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w, 8)
    q = quantize_rows(w, DataType.INT8)
    assert torch.equal(q.data, fused[:, :-4]) and torch.equal(q.scale_bias, fused[:, -4:])
    data, scale_bias = torch.empty(1000, 64, dtype=torch.uint8), torch.empty(1000, 4, dtype=torch.uint8)
    worst, _ = quantize_measured_into(w, DataType.INT8, False, data, scale_bias)
    assert torch.equal(data, fused[:, :-4]) and torch.equal(scale_bias, fused[:, -4:])
    assert worst == quantize_measured(w, DataType.INT8)[1]


def test_bad_arguments_are_refused():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"data \[4, 8\]"):
        int8_kernel.quantize_int8_into(w, torch.empty(4, 9, dtype=torch.uint8), torch.empty(4, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float32"):
        int8_kernel.quantize_int8_into(w.double(), torch.empty(4, 8, dtype=torch.uint8), torch.empty(4, 4, dtype=torch.uint8))


def test_the_compiled_kernel_is_cached_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("RECSHIP_CACHE_DIR", str(tmp_path))
    assert int8_kernel.cache_dir() == tmp_path / "kernels"
    int8_kernel._library.cache_clear()
    try:
        assert int8_kernel.available()
        built = list((tmp_path / "kernels").iterdir())
        assert len(built) == 1 and built[0].name.startswith("rowwise_int8-") and built[0].suffix == ".so"
    finally:
        int8_kernel._library.cache_clear()
