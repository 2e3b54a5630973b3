"""The row kernels (recship.quantize.row_kernels) against what they replace, on random and adversarial rows (constant,
huge-range, subnormal, -0.0, ties, mirrored, few-valued, zero-ended, tiny-range; NaN/inf where said):
the INT8 kernel against fbgemm's FloatToFusedNBitRowwiseQuantizedSBHalf at 8 bits (the same bytes, the error fbgemm's
own dequantization gives); the search against a plain reference of its definition and the torch search (the same
(scale, bias) on every row); quantize_with against rowwise's torch codes and packing."""

import math

import pytest
import torch

from recship.modules.types import DataType
from recship.quantize import row_kernels
from recship.quantize.rowwise import (_best_range, _clip_candidates, _codes, _pack, _qparams, _search_block, quantize_measured,
                                      quantize_measured_into, quantize_rows)

pytestmark = pytest.mark.skipif(not row_kernels.available(), reason="no C compiler, or a CPU without AVX2/F16C")


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
    worst, total = row_kernels.quantize_int8_into(w, data, scale_bias)
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
    row_kernels.quantize_int8_into(w, data, scale_bias)
    assert torch.equal(data, fused[:, :-4]) and torch.equal(scale_bias, fused[:, -4:])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e38, -70000.0])
def test_a_row_that_cannot_be_stored_finite_is_reported(bad):
    # NaN/inf values, a span whose scale overflows fp16 (1e38), a min beyond fp16 (the bias is -inf)
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    w[17, 5] = bad
    data, scale_bias = torch.empty(40, 64, dtype=torch.uint8), torch.empty(40, 4, dtype=torch.uint8)
    assert row_kernels.quantize_int8_into(w, data, scale_bias) is None
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
        row_kernels.quantize_int8_into(w, torch.empty(4, 9, dtype=torch.uint8), torch.empty(4, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float32"):
        row_kernels.quantize_int8_into(w.double(), torch.empty(4, 8, dtype=torch.uint8), torch.empty(4, 4, dtype=torch.uint8))


def test_the_compiled_kernel_is_cached_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert row_kernels.cache_dir() == tmp_path / "recship" / "kernels"
    row_kernels._library.cache_clear()
    try:
        assert row_kernels.available()
        built = list((tmp_path / "recship" / "kernels").iterdir())
        assert len(built) == 1 and built[0].name.startswith("rowwise-") and built[0].suffix == ".so"
    finally:
        row_kernels._library.cache_clear()


# -- the error-minimising search -------------------------------------------------------------------------------


def _reference_best_range(w: torch.Tensor, bits: int):
    """The search's definition written plainly: every candidate of rowwise's grid on every row in order, a
    candidate replacing the best only where its squared error (torch's float32 sum) is strictly less."""
    levels = 2**bits - 1

    def qparams(lo, hi):
        bias = lo.half().float()
        scale = ((hi - bias) / levels).half().float()
        return torch.where(scale == 0, torch.ones_like(scale), scale), bias

    def sq_error(scale, bias):
        d = torch.round((w - bias[:, None]) * (1.0 / scale)[:, None]).clamp(0, levels)
        d = d * scale[:, None] + bias[:, None] - w
        return (d * d).sum(dim=1)

    lo, hi = torch.aminmax(w, dim=1)
    span = hi - lo
    best_scale, best_bias = qparams(lo, hi)
    best = sq_error(best_scale, best_bias)
    grid = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)  # rowwise._CLIP_GRID, in its order
    for a in grid:
        for b in grid:
            if (a, b) == (0.0, 0.0) or a + b >= 0.9:
                continue
            cut_a, cut_b = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
            scale, bias = qparams(lo + cut_a * span, hi - cut_b * span)
            err = sq_error(scale, bias)
            better = err < best  # NaN: never
            best_scale, best_bias, best = torch.where(better, scale, best_scale), torch.where(better, bias, best_bias), torch.where(better, err, best)
    return best_scale, best_bias


def _search_rows(kind: str, rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    if kind == "mirrored":  # symmetric rows: clipping the bottom or the top by the same fraction nearly ties
        half = torch.randn(rows, (dim + 1) // 2, generator=g) * torch.rand(rows, 1, generator=g)
        return torch.cat([half, -half], dim=1)[:, :dim].contiguous()
    if kind == "few_values":  # 2-4 distinct values: many candidates with equal (scale, bias) or equal errors
        values = torch.randn(rows, 4, generator=g)
        return values.gather(1, torch.randint(0, 1 + int(torch.randint(1, 4, (1,), generator=g)), (rows, dim), generator=g))
    if kind == "zero_ends":  # a min or max of 0, held as -0.0 or +0.0
        w = torch.rand(rows, dim, generator=g) * torch.where(torch.rand(rows, 1, generator=g) < 0.5, 1.0, -1.0)
        w[:, 0] = 0.0
        w[::3, 1] = -0.0
        return w
    if kind == "tiny_range":  # a tiny range around a large value: coarse fp16 scale and bias, repeated candidates
        return 100.0 + torch.rand(rows, dim, generator=g) * 10.0 ** -torch.randint(1, 6, (rows, 1), generator=g).float()
    return _rows(kind, rows, dim, g)


SEARCH_KINDS = ["random", "constant", "huge_range", "subnormal", "negative_zero", "ties", "mirrored", "few_values",
                "zero_ends", "tiny_range"]


@pytest.mark.parametrize("bits", [4, 2, 8])
@pytest.mark.parametrize("dim", [64, 12, 130])
def test_search_chooses_as_the_torch_search_on_every_row(bits, dim):

    g = torch.Generator().manual_seed(bits * 100 + dim)
    w = torch.cat([_search_rows(kind, 150, dim, g) for kind in SEARCH_KINDS])
    w[7, 3], w[8, 5], w[9, 0] = float("nan"), float("inf"), -float("inf")
    scale, bias = _best_range(w, bits)
    old_scale, old_bias = _search_block(w, bits)  # the torch search on the whole block
    ref_scale, ref_bias = _reference_best_range(w, bits)
    def bits_of(t):  # NaN and -0.0 compared by their bits
        return t.view(torch.int32)
    assert torch.equal(bits_of(scale), bits_of(old_scale)) and torch.equal(bits_of(bias), bits_of(old_bias))
    assert torch.equal(bits_of(scale), bits_of(ref_scale)) and torch.equal(bits_of(bias), bits_of(ref_bias))


@pytest.mark.parametrize("bits", [4, 2])
def test_search_kernel_decides_ordinary_rows_and_leaves_near_ties(bits):

    cut_lo, cut_hi = _clip_candidates()
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(4000, 64, generator=g) * 0.1
    scale, bias, decided = row_kernels.search_range(w, bits, cut_lo, cut_hi)
    assert float(decided.float().mean()) > 0.99  # the torch search is the exception
    ref_scale, ref_bias = _reference_best_range(w, bits)
    assert torch.equal(scale[decided], ref_scale[decided]) and torch.equal(bias[decided], ref_bias[decided])
    zero_min = torch.rand(50, 64, generator=g)
    zero_min[:, 0] = 0.0
    assert not bool(row_kernels.search_range(zero_min, bits, cut_lo, cut_hi)[2].any())  # torch's sign of zero


def test_search_range_refuses_what_it_cannot_do():
    cut = torch.zeros(64)
    with pytest.raises(ValueError, match="64 and 64 cuts"):
        row_kernels.search_range(torch.randn(4, 8), 4, cut, cut)
    with pytest.raises(ValueError, match="5000"):
        row_kernels.search_range(torch.randn(2, 5000), 4, cut[:3], cut[:3])


# -- rows quantized with given (scale, bias) ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [64, 12, 13, 130, 3])
def test_quantize_with_gives_the_torch_codes_and_packing(bits, dim):

    g = torch.Generator().manual_seed(bits * 1000 + dim)
    w = torch.cat([_search_rows(kind, 40, dim, g) for kind in SEARCH_KINDS])
    lo, hi = torch.aminmax(w, dim=1)
    for scale, bias in (_qparams(lo, hi, bits), _best_range(w, bits)):
        data, scale_bias = row_kernels.quantize_with(w, bits, scale, bias)
        assert torch.equal(data, _pack(_codes(w, scale, bias, bits), bits))
        assert torch.equal(scale_bias, torch.stack([scale.half(), bias.half()], dim=1).view(torch.uint8))
    w[5, dim // 2] = float("nan")
    assert row_kernels.quantize_with(w, bits, scale, bias) is None  # a NaN's code is torch's business
    # rows read with a stride; an inf or -inf value with finite (scale, bias): the top code and 0, as torch's clamp
    wide = torch.randn(6, dim + 7, generator=g)
    wide[1, 3], wide[2, 2 + dim] = float("inf"), -float("inf")
    scale, bias = torch.full((6,), 0.25), torch.full((6,), -1.0)
    data, _ = row_kernels.quantize_with(wide[:, 3 : 3 + dim], bits, scale, bias)
    assert torch.equal(data, _pack(_codes(wide[:, 3 : 3 + dim].contiguous(), scale, bias, bits), bits))


def test_a_cache_folder_that_cannot_be_written_leaves_the_torch_paths(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    row_kernels._library.cache_clear()
    try:
        assert not row_kernels.available()
        assert "rows are quantized by fbgemm's op and torch" in caplog.text
        w = torch.randn(100, 64, generator=torch.Generator().manual_seed(0))
        fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w, 8)
        q = quantize_rows(w, DataType.INT8)
        assert torch.equal(q.data, fused[:, :-4])
    finally:
        row_kernels._library.cache_clear()
