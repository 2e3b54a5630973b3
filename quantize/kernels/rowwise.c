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
