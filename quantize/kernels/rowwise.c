/* INT8 rows in fbgemm's TBE format, with their quantization error, in one pass over the float rows.
 *
 * Bit-equal to fbgemm's FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfAvx2<float, 8> (what
 * torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w, 8) runs on an AVX2 host), whose 8-bit
 * codes go through a scalar lrintf loop (~2 GB/s per core); here they are vectorised. Step by step as
 * fbgemm does it:
 *   - min/max: 8 lanes of _mm256_min_ps/_mm256_max_ps over the full groups of 8 values (a lane keeps the
 *     newer of two equal values: which of -0.0 and +0.0 is the min depends on this order), the lanes folded
 *     by std::min/std::max (the older wins a tie), then the tail values one by one, also by std::min/max;
 *   - bias = fp16(min); scale = fp16((max - float(bias)) / 255) (1 for a zero range), 1 where it rounds to
 *     0, and 1 where 1/scale is inf; stored as [fp16 scale | fp16 bias];
 *   - code = clamp(round_half_even((x - bias) * (1 / scale)), 0, 255): mul and sub, never fused (this file
 *     is compiled with -ffp-contract=off).
 * The error is what fbgemm's dequantization gives back, |code * scale + bias - x| in float (the product is
 * exact: 8 x 11 significant bits), reduced to its max (float) and its sum (double, row by row in order:
 * torch's sum of the same floats may differ in the last bits of the double).
 *
 * A row holding NaN or inf, or one whose scale or bias overflows fp16, has a non-finite error: such rows
 * are counted, and the caller treats the whole block as fbgemm's op would (recship refuses to store them).
 * Their bytes are not fbgemm's (lrintf and _mm256_cvtps_epi32 differ out of range) and must not be used.
 */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* 1 when this CPU runs the kernel (AVX2 and F16C), 0 otherwise (the caller uses fbgemm's op then). */
int recship_int8_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

__attribute__((target("avx2,f16c"))) static inline uint16_t to_half(float x) {
  return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

__attribute__((target("avx2,f16c"))) static inline float from_half(uint16_t h) { return _cvtsh_ss(h); }

/* The min and max of one row as fbgemm's AVX2 kernel finds them (see the top of this file). */
__attribute__((target("avx2,f16c"))) static inline void row_range(const float* x, int64_t dim, float* lo_out, float* hi_out) {
  const int64_t full = dim / 8 * 8;
  __m256 min_v = _mm256_set1_ps(FLT_MAX), max_v = _mm256_set1_ps(-FLT_MAX);
  int64_t c = 0;
  for (; c < full; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    min_v = _mm256_min_ps(min_v, v);
    max_v = _mm256_max_ps(max_v, v);
  }
  float min_buf[8], max_buf[8];
  _mm256_storeu_ps(min_buf, min_v);
  _mm256_storeu_ps(max_buf, max_v);
  float lo = FLT_MAX, hi = -FLT_MAX;
  for (int i = 0; i < 8; ++i) {
    lo = min_buf[i] < lo ? min_buf[i] : lo;  /* std::min(lo, b) */
    hi = hi < max_buf[i] ? max_buf[i] : hi;  /* std::max(hi, b) */
  }
  for (; c < dim; ++c) {
    lo = x[c] < lo ? x[c] : lo;
    hi = hi < x[c] ? x[c] : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
}

/* Quantizes rows [rows, dim] (row r at w + r * w_stride floats) into data (row r at data + r * data_stride:
 * dim code bytes) and scale_bias (row r at scale_bias + r * sb_stride: fp16 scale, fp16 bias). Writes the
 * largest |error| to *max_err and the sum of |error| to *sum_err; returns the number of rows whose error is
 * not finite (then neither figure means anything).
 *
 * Rows go 8 at a time: their ranges first, then their scales and biases as one vector (the chain of fp16
 * roundings and divisions is long; one row at a time it bounded the kernel at ~3.6 GB/s), then their codes. */
__attribute__((target("avx2,f16c"))) int64_t recship_quantize_int8(
    const float* w, int64_t rows, int64_t dim, int64_t w_stride, uint8_t* data, int64_t data_stride,
    uint8_t* scale_bias, int64_t sb_stride, float* max_err, double* sum_err) {
  const int64_t full = dim / 8 * 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 finite_max = _mm256_set1_ps(FLT_MAX);
  const __m256 one = _mm256_set1_ps(1.0f), zero_f = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);
  const __m256i zero = _mm256_setzero_si256(), top = _mm256_set1_epi32(255);
  __m256 worst_v = _mm256_setzero_ps();
  float worst = 0.0f;
  double total = 0.0;
  int64_t bad_rows = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int group = rows - r0 < 8 ? (int)(rows - r0) : 8;
    float lo[8] = {0}, hi[8] = {0}, scales[8], biases[8], inverses[8];
    uint16_t scale_h[8], bias_h[8];
    for (int j = 0; j < group; ++j) row_range(w + (r0 + j) * w_stride, dim, &lo[j], &hi[j]);
    const __m128i bias_hv = _mm256_cvtps_ph(_mm256_loadu_ps(lo), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 bias = _mm256_cvtph_ps(bias_hv);
    const __m256 range = _mm256_sub_ps(_mm256_loadu_ps(hi), bias);
    __m256 scale = _mm256_blendv_ps(_mm256_div_ps(range, _mm256_set1_ps(255.0f)), one, _mm256_cmp_ps(range, zero_f, _CMP_EQ_OQ));
    scale = _mm256_cvtph_ps(_mm256_cvtps_ph(scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    scale = _mm256_blendv_ps(scale, one, _mm256_cmp_ps(scale, zero_f, _CMP_EQ_OQ));
    __m256 inverse = _mm256_div_ps(one, scale);
    const __m256 inf_inverse = _mm256_cmp_ps(_mm256_and_ps(inverse, abs_mask), inf, _CMP_EQ_OQ);  /* std::isinf */
    scale = _mm256_blendv_ps(scale, one, inf_inverse);
    inverse = _mm256_blendv_ps(inverse, one, inf_inverse);
    _mm_storeu_si128((__m128i*)scale_h, _mm256_cvtps_ph(scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i*)bias_h, bias_hv);
    _mm256_storeu_ps(scales, scale);
    _mm256_storeu_ps(biases, bias);
    _mm256_storeu_ps(inverses, inverse);

    for (int j = 0; j < group; ++j) {
      const int64_t r = r0 + j;
      const float* x = w + r * w_stride;
      uint8_t* out = data + r * data_stride;
      const uint16_t qparams[2] = {scale_h[j], bias_h[j]};
      memcpy(scale_bias + r * sb_stride, qparams, sizeof(qparams));
      const __m256 bias_v = _mm256_set1_ps(biases[j]), inverse_v = _mm256_set1_ps(inverses[j]);
      const __m256 scale_v = _mm256_set1_ps(scales[j]);
      __m256 finite_v = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      __m256d sum_lo = _mm256_setzero_pd(), sum_hi = _mm256_setzero_pd();
      int64_t c = 0;
      for (; c < full; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(v, bias_v), inverse_v));  /* round half to even */
        q = _mm256_min_epi32(_mm256_max_epi32(q, zero), top);
        const __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i*)(out + c), _mm_packus_epi16(q16, q16));
        const __m256 back = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), scale_v), bias_v);
        const __m256 err = _mm256_and_ps(_mm256_sub_ps(back, v), abs_mask);
        finite_v = _mm256_and_ps(finite_v, _mm256_cmp_ps(err, finite_max, _CMP_LE_OQ));  /* false for NaN and inf */
        worst_v = _mm256_max_ps(worst_v, err);
        sum_lo = _mm256_add_pd(sum_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(err)));
        sum_hi = _mm256_add_pd(sum_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(err, 1)));
      }
      double sum_buf[4];
      _mm256_storeu_pd(sum_buf, _mm256_add_pd(sum_lo, sum_hi));
      int finite = _mm256_movemask_ps(finite_v) == 0xff;
      double row_sum = (sum_buf[0] + sum_buf[1]) + (sum_buf[2] + sum_buf[3]);
      for (; c < dim; ++c) {
        long q = lrintf((x[c] - biases[j]) * inverses[j]);
        q = q < 0 ? 0 : (q > 255 ? 255 : q);
        out[c] = (uint8_t)q;
        const float err = fabsf((float)q * scales[j] + biases[j] - x[c]);
        finite &= err <= FLT_MAX;
        worst = err > worst ? err : worst;
        row_sum += err;
      }
      bad_rows += !finite;
      total += row_sum;
    }
  }
  float worst_buf[8];
  _mm256_storeu_ps(worst_buf, worst_v);
  for (int i = 0; i < 8; ++i) worst = worst_buf[i] > worst ? worst_buf[i] : worst;
  *max_err = worst;
  *sum_err = total;
  return bad_rows;
}

/* ------------------------------------------------------------------------------------------------------
 * The error-minimising search of INT4/INT2 (and INT8) ranges: recship.quantize.rowwise._best_range's choice.
 *
 * For each row: the min/max (scale, bias) and one per clipping candidate, each computed by the float ops of
 * rowwise.py (_qparams: bias = fp16(lo), scale = fp16((hi - bias) / levels), 1 where that is 0; a candidate
 * clips lo + cut_lo * span and hi - cut_hi * span), and each one's squared error by _sq_error's float ops:
 * d = round_half_even((x - bias) * (1 / scale)) clamped to [0, levels], then (d * scale + bias - x)^2.
 * Those terms are the very floats torch computes; only their sum's order differs from torch's. Any order of
 * a float sum of n non-negative terms is within gamma = n * 2^-24 (relative) of the exact sum, so two sums
 * whose values here differ by more than 2.5 gamma compare the same way in torch. A row is decided here only
 * where that settles the choice (the first least error, min/max winning ties: a candidate whose (scale,
 * bias) equals min/max's or an earlier candidate's can never be chosen and is skipped); otherwise it is left
 * undecided for the torch search (near ties, a NaN or inf, a row whose min or max is 0: which of -0.0 and
 * +0.0 torch.aminmax returns is its own business).
 */

static inline int same_bits(float a, float b) {
  uint32_t x, y;
  memcpy(&x, &a, sizeof(x));
  memcpy(&y, &b, sizeof(y));
  return x == y;
}

/* The per-lane partial sums of (clamp(round_half_even((x - bias) * inverse), 0, levels) * scale + bias - x)^2
 * over a row's full groups of 8 values. */
__attribute__((target("avx2,f16c"))) static inline __m256 sq_error_lanes(const float* x, int64_t full, __m256 scale_v,
                                                                         __m256 bias_v, __m256 inverse_v, __m256 top) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < full; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    __m256 d = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, bias_v), inverse_v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    d = _mm256_min_ps(_mm256_max_ps(d, zero), top);
    d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(d, scale_v), bias_v), v);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(d, d));
  }
  return acc;
}

/* [sum of a[0]'s lanes, ..., sum of a[7]'s lanes] */
__attribute__((target("avx2,f16c"))) static inline __m256 lane_sums(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The sum of the error terms of a row's values after its full groups of 8 (one by one, as sq_error_lanes). */
static inline float tail_sq_error(const float* x, int64_t full, int64_t dim, float scale, float bias, float inverse, float levels) {
  float sum = 0.0f;
  for (int64_t c = full; c < dim; ++c) {
    float d = nearbyintf((x[c] - bias) * inverse);
    d = d < 0.0f ? 0.0f : (d > levels ? levels : d);
    d = d * scale + bias - x[c];
    sum += d * d;
  }
  return sum;
}

#define SEARCH_SLOTS 64 /* min/max and at most 63 candidates */

/* rows [rows, dim] (row r at w + r * w_stride floats), ``candidates`` clipping fractions cut_lo / cut_hi (the
 * search order, min/max left out): writes each decided row's (scale, bias) and decided[r] = 1, decided[r] = 0
 * for the others; returns the number undecided (-1: more than 63 candidates or dim > 4096). */
__attribute__((target("avx2,f16c"))) int64_t recship_search_range(const float* w, int64_t rows, int64_t dim, int64_t w_stride,
                                                                  int bits, const float* cut_lo, const float* cut_hi,
                                                                  int64_t candidates, float* scale_out, float* bias_out,
                                                                  uint8_t* decided) {
  if (candidates + 1 > SEARCH_SLOTS || dim > 4096) return -1;
  const float levels = (float)((1 << bits) - 1);
  const double e = 2.5 * (double)dim * 0x1p-24;  /* 2.5 gamma: see above */
  const int64_t slots = candidates + 1, groups = (slots + 7) / 8, full = dim / 8 * 8;
  /* slot 0: min/max (no cut); the grid after it; the last group padded with min/max again (never chosen) */
  float cut_lo_all[SEARCH_SLOTS] = {0}, cut_hi_all[SEARCH_SLOTS] = {0};
  memcpy(cut_lo_all + 1, cut_lo, candidates * sizeof(float));
  memcpy(cut_hi_all + 1, cut_hi, candidates * sizeof(float));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), finite_max = _mm256_set1_ps(FLT_MAX);
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), levels_v = _mm256_set1_ps(levels);
  int64_t undecided = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = w + r * w_stride;
    decided[r] = 0;
    __m256 min_v = _mm256_set1_ps(FLT_MAX), max_v = _mm256_set1_ps(-FLT_MAX);
    __m256 finite_v = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t c = 0; c < full; c += 8) {
      const __m256 v = _mm256_loadu_ps(x + c);
      min_v = _mm256_min_ps(min_v, v);
      max_v = _mm256_max_ps(max_v, v);
      finite_v = _mm256_and_ps(finite_v, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), finite_max, _CMP_LE_OQ));
    }
    float min_buf[8], max_buf[8];
    _mm256_storeu_ps(min_buf, min_v);
    _mm256_storeu_ps(max_buf, max_v);
    int finite = _mm256_movemask_ps(finite_v) == 0xff;
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int i = 0; i < 8; ++i) {
      lo = min_buf[i] < lo ? min_buf[i] : lo;
      hi = max_buf[i] > hi ? max_buf[i] : hi;
    }
    for (int64_t c = full; c < dim; ++c) {
      finite &= isfinite(x[c]) != 0;
      lo = x[c] < lo ? x[c] : lo;
      hi = x[c] > hi ? x[c] : hi;
    }
    if (!finite || lo == 0.0f || hi == 0.0f) {  /* NaN/inf: torch's rules; a zero min or max: its sign is torch's */
      ++undecided;
      continue;
    }
    const __m256 lo_v = _mm256_set1_ps(lo), hi_v = _mm256_set1_ps(hi), span_v = _mm256_set1_ps(hi - lo);
    float scales[SEARCH_SLOTS], biases[SEARCH_SLOTS], inverses[SEARCH_SLOTS], sums[SEARCH_SLOTS];
    double bounds[SEARCH_SLOTS];
    for (int64_t g = 0; g < groups; ++g) {
      /* 8 slots' (scale, bias) by _qparams' float ops, and the lower bound of _search_block on their error */
      const __m256 clo = g == 0 ? _mm256_blend_ps(_mm256_add_ps(lo_v, _mm256_mul_ps(_mm256_loadu_ps(cut_lo_all), span_v)), lo_v, 1)
                                : _mm256_add_ps(lo_v, _mm256_mul_ps(_mm256_loadu_ps(cut_lo_all + 8 * g), span_v));
      const __m256 chi = g == 0 ? _mm256_blend_ps(_mm256_sub_ps(hi_v, _mm256_mul_ps(_mm256_loadu_ps(cut_hi_all), span_v)), hi_v, 1)
                                : _mm256_sub_ps(hi_v, _mm256_mul_ps(_mm256_loadu_ps(cut_hi_all + 8 * g), span_v));
      const __m256 bias = _mm256_cvtph_ps(_mm256_cvtps_ph(clo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      __m256 scale = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(chi, bias), levels_v),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      scale = _mm256_blendv_ps(scale, one, _mm256_cmp_ps(scale, zero, _CMP_EQ_OQ));
      _mm256_storeu_ps(scales + 8 * g, scale);
      _mm256_storeu_ps(biases + 8 * g, bias);
      _mm256_storeu_ps(inverses + 8 * g, _mm256_div_ps(one, scale));
      const __m256 tops = _mm256_add_ps(_mm256_mul_ps(scale, levels_v), bias);
      const __m256 below = _mm256_max_ps(_mm256_sub_ps(_mm256_min_ps(bias, tops), lo_v), zero);
      const __m256 above = _mm256_max_ps(_mm256_sub_ps(hi_v, _mm256_max_ps(bias, tops)), zero);
      const __m256 below2 = _mm256_mul_ps(below, below), above2 = _mm256_mul_ps(above, above);
      _mm256_storeu_pd(bounds + 8 * g, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(below2)),
                                                     _mm256_cvtps_pd(_mm256_castps256_ps128(above2))));
      _mm256_storeu_pd(bounds + 8 * g + 4, _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(below2, 1)),
                                                         _mm256_cvtps_pd(_mm256_extractf128_ps(above2, 1))));
    }
    /* min/max's error, then the candidates whose bound does not rule them out, 8 at a time */
    {
      __m256 acc[8];
      acc[0] = sq_error_lanes(x, full, _mm256_set1_ps(scales[0]), _mm256_set1_ps(biases[0]), _mm256_set1_ps(inverses[0]),
                              levels_v);
      for (int i = 1; i < 8; ++i) acc[i] = zero;
      float lanes[8];
      _mm256_storeu_ps(lanes, lane_sums(acc));
      sums[0] = lanes[0] + tail_sq_error(x, full, dim, scales[0], biases[0], inverses[0], levels);
    }
    const double err0 = sums[0];
    int64_t todo[SEARCH_SLOTS], count = 0;
    for (int64_t k = 1; k < slots; ++k)
      if (!(bounds[k] * (1 - 0x1p-16) >= err0 * (1 + e))) todo[count++] = k;  /* a NaN bound stays to do */
    for (int64_t start = 0; start < count; start += 8) {
      __m256 acc[8];
      const int64_t n = count - start < 8 ? count - start : 8;
      for (int64_t i = 0; i < 8; ++i) {
        const int64_t k = todo[start + (i < n ? i : 0)];
        acc[i] = sq_error_lanes(x, full, _mm256_set1_ps(scales[k]), _mm256_set1_ps(biases[k]), _mm256_set1_ps(inverses[k]),
                                levels_v);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, lane_sums(acc));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t k = todo[start + i];
        sums[k] = lanes[i] + tail_sq_error(x, full, dim, scales[k], biases[k], inverses[k], levels);
      }
    }
    /* the choice: the first least error among the candidates, taken only if below min/max's (a candidate ruled out
       by its bound has an error >= min/max's: never taken) */
    int64_t best = 0;
    int settled = isfinite(sums[0]) != 0;
    if (settled && err0 != 0.0 && count > 0) {  /* an error of 0 is exact in any order: nothing is below it */
      int64_t first = todo[0];
      for (int64_t i = 0; i < count; ++i) {
        settled &= isfinite(sums[todo[i]]) != 0;
        if (sums[todo[i]] < sums[first]) first = todo[i];
      }
      /* a candidate with first's (scale, bias) has its error (a later one, tied: first wins); any other must be
         clearly above it */
      for (int64_t i = 0; settled && i < count; ++i) {
        const int64_t k = todo[i];
        if (k != first && !(same_bits(scales[k], scales[first]) && same_bits(biases[k], biases[first])))
          settled = sums[first] * (1 + e) < sums[k] * (1 - e);
      }
      const int as_min_max = same_bits(scales[first], scales[0]) && same_bits(biases[first], biases[0]);
      if (settled && !as_min_max) {
        if (sums[first] * (1 + e) < err0 * (1 - e))
          best = first;
        else
          settled = sums[first] * (1 - e) >= err0 * (1 + e);
      }
    }
    if (!settled) {
      ++undecided;
      continue;
    }
    scale_out[r] = scales[best];
    bias_out[r] = biases[best];
    decided[r] = 1;
  }
  return undecided;
}

/* ------------------------------------------------------------------------------------------------------
 * Rows quantized with given (scale, bias): recship.quantize.rowwise's _codes and _pack, bit for bit.
 * code = clamp(round_half_even((x - bias) * (1 / scale)), 0, 2^bits - 1), packed low bits first (8 / bits codes a
 * byte, the last byte of a row padded with zero codes); scale_bias holds [fp16(scale) | fp16(bias)]. Returns the
 * number of values whose code is not a number (a NaN or inf in the row, a NaN scale or bias): then the rows are
 * not rowwise.py's, and the caller quantizes them there.
 */
__attribute__((target("avx2,f16c"))) int64_t recship_quantize_with(const float* w, int64_t rows, int64_t dim, int64_t w_stride,
                                                                   int bits, const float* scale, const float* bias, uint8_t* data,
                                                                   int64_t data_stride, uint8_t* scale_bias, int64_t sb_stride) {
  const float levels = (float)((1 << bits) - 1);
  const int per_byte = 8 / bits;
  const int64_t full = dim / 8 * 8;
  const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(levels);
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = w + r * w_stride;
    uint8_t* out = data + r * data_stride;
    const float inverse = 1.0f / scale[r];
    const uint16_t qparams[2] = {to_half(scale[r]), to_half(bias[r])};
    memcpy(scale_bias + r * sb_stride, qparams, sizeof(qparams));
    const __m256 bias_v = _mm256_set1_ps(bias[r]), inverse_v = _mm256_set1_ps(inverse);
    uint8_t codes[8];
    __m256 ordered = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    int64_t c = 0;
    for (; c < full; c += 8) {
      __m256 d = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + c), bias_v), inverse_v),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      ordered = _mm256_and_ps(ordered, _mm256_cmp_ps(d, d, _CMP_ORD_Q));
      d = _mm256_min_ps(_mm256_max_ps(d, zero), top);
      const __m256i q = _mm256_cvttps_epi32(d);
      const __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64((__m128i*)codes, _mm_packus_epi16(q16, q16));
      for (int i = 0; i < 8; i += per_byte) {
        uint8_t byte = 0;
        for (int j = 0; j < per_byte; ++j) byte |= (uint8_t)(codes[i + j] << (j * bits));
        out[(c + i) / per_byte] = byte;
      }
    }
    bad += 8 - __builtin_popcount(_mm256_movemask_ps(ordered));
    for (; c < dim; ++c) {
      float d = nearbyintf((x[c] - bias[r]) * inverse);
      if (d != d) {
        ++bad;
        d = 0.0f;
      }
      d = d < 0.0f ? 0.0f : (d > levels ? levels : d);
      const int64_t byte = c / per_byte, shift = (c % per_byte) * bits;
      if (shift == 0) out[byte] = 0;
      out[byte] |= (uint8_t)((int)d << shift);
    }
  }
  return bad;
}
