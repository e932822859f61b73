/* What the int8 and int4 products at float32's precision share: x written as four int8 digits, the matrix, and the
 * scalar loop for the rows the digits cannot hold. quantized_amx.c multiplies the digits on the matrix units (any
 * number of rows), quantized_vnni.c on the vector units (one row: a decode step's); minillm/quantize.py's formats,
 *
 *   int8  ŵ[o, k] = q[o, k] · scale[o]                   q int8 [out, in] (row-major), scale float32 [out]
 *   int4  ŵ[o, k] = (q[o, k] - zero[o, g]) · scale[o, g]  packed uint8 [out, in/2] (byte j = q[2j] | q[2j+1] << 4),
 *         g = k / group                                   scale float32, zero uint8 [out, in/group]
 *
 *   x float32 [rows, in],  y float32 [rows, out],  y = x @ ŵᵀ
 *
 * Both units multiply-add int8 by int8 into int32, exactly. x is float32, so each row is written as four int8
 * digits in base 254 under a power-of-two scale s (s chosen so that max|x| / s lies in [63.5, 127], which makes
 * x / s exact):
 *
 *   x[k] / s = d0[k] + d1[k] / 254 + d2[k] / 254² + d3[k] / 254³ + ε[k]      (each digit in [-127, 127])
 *   int8  y[r, o] = scale[o] · s · (D0 + (D1 + (D2 + D3 / 254) / 254) / 254),   Dc = Σ_k q[o, k] · dc[k]   (int32)
 *   int4  the same with scale[o] · Dc replaced by Σ_g scale[o, g] · Σ_{k in g} (q[o, k] - zero[o, g]) · dc[k]
 *
 * ε is the last digit's rounding, 0.5 / 254³, and the float32 rounding of the residuals as they are scaled up, as
 * much again: |ε · s| < 1e-9 of the row's largest |x|, and the Dc are exact. So the result differs from
 * F.linear(x, ŵ) by about float32's rounding even where a row holds outliers 10^4 times its typical value (as
 * SmolLM2's down projections' inputs do: three digits, an error 1.2e-7 of the largest, gave them up to 94x float32's
 * error; beyond ~10^5 the error grows with the ratio): the activations are not quantised (llama.cpp's Q8_0 rounds
 * them to 8 bits, one digit). tests/fast/test_quantized_amx.py and test_quantized_vnni.py check it against float64.
 *
 * A row of zeros gives zeros; a row with a NaN or an infinity, or whose largest |x| is outside [2^-100, 2^100] (its
 * scale would overflow), is computed by a scalar loop instead (scalar_row): F.linear's NaN and infinities. The int32
 * sums hold for in <= 131072. Results in float32's range stay in it: x's power-of-two scale s goes in before the
 * weights' scales (a scale times s, or a group's sum times its scale, can leave the range where the result does
 * not). Needs AVX-512 with VNNI (an Intel Xeon from Cascade Lake, AMD from Zen 4).
 */
#ifndef MINILLM_QUANTIZED_DIGITS_H
#define MINILLM_QUANTIZED_DIGITS_H

#include "common.h"

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QUANTIZED_DIGITS 1

#define DIGITS 4
#define BASE 254.0f
#define MAX_IN 131072  /* the int32 sums' bound */

/* Row r's scale s (a power of two, max|x| / s in [63.5, 127]); 0 for a row of zeros (its digits are zeros, and so
 * its products); -1 when the scalar loop takes the row. */
static inline float row_scale(const float *x, int in) {
    __m512 big = _mm512_setzero_ps();
    __mmask16 odd = 0;
    for (int k = 0; k < in; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        odd |= _mm512_fpclass_ps_mask(v, 0x99);  /* NaN (quiet, signalling) or ±infinity */
        big = _mm512_max_ps(big, _mm512_abs_ps(v));
    }
    float m = _mm512_reduce_max_ps(big);
    if (m == 0.0f && !odd) return 0.0f;
    if (odd || !(m >= 0x1p-100f && m <= 0x1p100f)) return -1.0f;
    int e;
    frexpf(m / 127.0f, &e);  /* m / 127 <= 2^e */
    float s = ldexpf(1.0f, e);
    return m / s > 127.0f ? 2.0f * s : s;  /* (m / 127 rounded down past a power of two) */
}

/* x [rows, in] -> the DIGITS digit rows of each (digits [rows][DIGITS][in] int8), s per row in row_s. */
static inline void digits_of(const float *x, int8_t *digits, float *row_s, int r, int in) {
    const float *xr = x + (int64_t)r * in;
    int8_t *d = digits + (int64_t)r * DIGITS * in;
    float s = row_s[r] = row_scale(xr, in);
    if (s <= 0.0f) {
        memset(d, 0, (size_t)DIGITS * in);
        return;
    }
    __m512 inv = _mm512_set1_ps(1.0f / s), base = _mm512_set1_ps(BASE);
    for (int k = 0; k < in; k += 16) {
        __m512 u = _mm512_mul_ps(_mm512_loadu_ps(xr + k), inv);  /* exact: s is a power of two */
        __m512 d0 = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 e1 = _mm512_mul_ps(_mm512_sub_ps(u, d0), base);
        __m512 d1 = _mm512_roundscale_ps(e1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 e2 = _mm512_mul_ps(_mm512_sub_ps(e1, d1), base);
        __m512 d2 = _mm512_roundscale_ps(e2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 e3 = _mm512_mul_ps(_mm512_sub_ps(e2, d2), base);
        _mm_storeu_si128((__m128i *)(d + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(d0)));
        _mm_storeu_si128((__m128i *)(d + in + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(d1)));
        _mm_storeu_si128((__m128i *)(d + 2 * in + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(d2)));
        _mm_storeu_si128((__m128i *)(d + 3 * in + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(e3)));
    }
}

typedef struct {  /* the matrix: int8 codes when zero is NULL, else int4 */
    const void *codes;
    const float *scale;
    const uint8_t *zero;
    int out, in, group;
} matrix;

/* ŵ[o, k], in float64: q · scale can pass float32's range (127 · 3e38) where x · ŵ does not */
static inline double weight_at(const matrix *m, int64_t o, int k) {
    if (m->zero == NULL) return (double)((const int8_t *)m->codes)[o * m->in + k] * m->scale[o];
    int groups = m->in / m->group, g = k / m->group;
    int q = (((const uint8_t *)m->codes)[o * (m->in / 2) + k / 2] >> (4 * (k % 2))) & 15;
    return (double)(q - m->zero[o * groups + g]) * m->scale[o * groups + g];
}

/* Row r of y by the scalar loop (a row row_scale gave -1). */
static inline void scalar_row(const float *x, const matrix *m, float *y, int r, int threads) {
    const float *xr = x + (int64_t)r * m->in;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < m->out; o++) {  /* in float64: a float32 sum missed float32's bound up to 13x (in = 131072) */
        double sum = 0.0;
        for (int k = 0; k < m->in; k++) sum += (double)xr[k] * weight_at(m, o, k);
        y[(int64_t)r * m->out + o] = (float)sum;
    }
}

#endif

/* quantized_vnni.c's entry points, which quantized.c and quantized_amx.c call at one row */
int int8_vnni_matvec(const float *x, const int8_t *q, const float *scale, float *y, int out, int in, int threads);
int int4_vnni_matvec(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero, float *y, int out,
                     int in, int group, int threads);

#endif
