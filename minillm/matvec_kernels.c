/* Decode's products: y = x @ wᵀ for a few rows of x, reading each weight once; quantised matrices
 * are read as their packed codes.
 *
 * Built at first use by minillm/matvec_kernels.py (cc -O3 -march=native -fopenmp, under a second)
 * and called through ctypes. The quantised arithmetic is minillm/quantize.py's reference path,
 * reordered:
 *
 *   f32   y[r, o] = Σ_i x[r, i] · w[o, i]
 *   int8  y[r, o] = scale[o] · Σ_i x[r, i] · q[o, i]
 *   int4  y[r, o] = Σ_g scale[o, g] · (Σ_{i in g} x[r, i] · q[o, i]  -  zero[o, g] · Σ_{i in g} x[r, i])
 *
 * (the zero point comes out of each group's sum, as in GPTQ's kernels). Each output o is one
 * thread's work (OpenMP, `threads` of them); its row of codes is read once for all rows of x.
 *
 * Layouts (row-major, as QuantizedLinear stores them):
 *   x      float32 [rows, in]           y      float32 [rows, out]
 *   w      float32 [out, in]                                                            (f32)
 *   q      int8    [out, in]            scale  float32 [out]                        (int8)
 *   packed uint8   [out, in/2]          scale  float32 [out, in/group]
 *          byte j = q[2j] | q[2j+1] << 4                    zero   uint8   [out, in/group]   (int4)
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static float hsum(__m256 v) {  /* the sum of 8 lanes */
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, v);
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}
#endif

/* Σ_i x[i]·w[i] in float32. AVX2: four vector sums of 8 lanes, so that four multiply-adds are in
 * flight; the loop reads w as fast as the memory delivers it (int8_dot below says why four). */
static float f32_dot(const float *w, const float *x, int n) {
    float sum = 0.0f;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * k), _mm256_loadu_ps(w + i + 8 * k), acc[k]);
    sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
    for (; i < n; i++) sum += x[i] * w[i];
    return sum;
}

/* y[r·y_stride] = Σ_i w[i]·x[r·n + i] for R <= 4 rows of x [R, n]: each 8 weights are loaded once
 * for R multiply-adds, two vector sums a row (inlined with R a constant: its loops unroll). A
 * speculative verify pass multiplies 1 + k rows: one row at a time, 9 rows took 1.3x longer than
 * this on SmolLM2's matrices (developers' EPYC). One row keeps f32_dot's four sums in flight. */
static inline __attribute__((always_inline)) void f32_dots(const float *w, const float *x, int n, int R,
                                                           float *y, int64_t y_stride) {
    int i = 0;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * n + i), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * n + i + 8), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) sum[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
#endif
    for (int r = 0; r < R; r++) {
        for (int j = i; j < n; j++) sum[r] += w[j] * x[r * n + j];
        y[r * y_stride] = sum[r];
    }
}

/* The float32 product of a decode step or a verify pass: MKL's product of a few rows runs on one
 * core, which cannot stream memory as fast as all of them (minillm.model.linear says more). */
void f32_matvec(const float *x, const float *w, float *y, int rows, int out, int in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++) {
        const float *wo = w + (int64_t)o * in;
        if (rows == 1) {
            y[o] = f32_dot(wo, x, in);
            continue;
        }
        for (int r = 0; r < rows; r += 4) {
            const float *xr = x + (int64_t)r * in;
            float *yr = y + (int64_t)r * out + o;
            switch (rows - r < 4 ? rows - r : 4) {  /* R a constant in each call: its loops unroll */
                case 4: f32_dots(wo, xr, in, 4, yr, out); break;
                case 3: f32_dots(wo, xr, in, 3, yr, out); break;
                case 2: f32_dots(wo, xr, in, 2, yr, out); break;
                default: f32_dots(wo, xr, in, 1, yr, out);
            }
        }
    }
}

/* Σ_i x[i]·q[i]. AVX2: 8 codes widened to 8 floats, times 8 of x, into one of four vector sums,
 * so that four multiply-adds are in flight (one running sum waits out each one's latency: the
 * compiler's vectorised loop took SmolLM2's 49152x576 head 2.3 ms against 1.3, developers' EPYC). */
static float int8_dot(const int8_t *q, const float *x, int n) {
    float sum = 0.0f;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i + 8 * k)));
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * k), _mm256_cvtepi32_ps(codes), acc[k]);
        }
    sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
    for (; i < n; i++) sum += x[i] * (float)q[i];
    return sum;
}

void int8_matvec(const float *x, const int8_t *q, const float *scale, float *y,
                 int rows, int out, int in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int r = 0; r < rows; r++)
            y[(int64_t)r * out + o] = scale[o] * int8_dot(q + (int64_t)o * in, x + (int64_t)r * in, in);
}

/* One output of int4: Σ_g scale[g] · (Σ_j xe[j]·low(b[j]) + xo[j]·high(b[j])  -  zero[g] · xsum[g]),
 * j over the group's bytes, with xe, xo the even and odd elements of x (the low and high nibbles'
 * partners). AVX2: 8 bytes widened to 8 int32 lanes, the two nibbles split by a mask and a shift,
 * each multiplied into its own vector sum (two multiply-adds in flight), the lanes summed once per
 * output. The compiler's vectorisation of the portable loop took SmolLM2's 49152x576 head 10.3 ms
 * against 1.4 (developers' AMD EPYC). */
static float int4_dot(const uint8_t *b, const float *scale, const uint8_t *zero, const float *xe,
                      const float *xo, const float *xsum, int groups, int half_group) {
    float zero_term = 0.0f;
    for (int g = 0; g < groups; g++) zero_term += scale[g] * zero[g] * xsum[g];
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256 dot_low = _mm256_setzero_ps(), dot_high = _mm256_setzero_ps();
        for (int j = g * half_group; j < (g + 1) * half_group; j += 8) {
            __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + j)));
            __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
            __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
            dot_low = _mm256_fmadd_ps(_mm256_loadu_ps(xe + j), low, dot_low);
            dot_high = _mm256_fmadd_ps(_mm256_loadu_ps(xo + j), high, dot_high);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(scale[g]), _mm256_add_ps(dot_low, dot_high), acc);
    }
    float sum = hsum(acc);
#else
    float sum = 0.0f;
    for (int g = 0; g < groups; g++) {
        float dot = 0.0f;
        for (int j = g * half_group; j < (g + 1) * half_group; j++)
            dot += xe[j] * (float)(b[j] & 15) + xo[j] * (float)(b[j] >> 4);
        sum += scale[g] * dot;
    }
#endif
    return sum - zero_term;
}

/* group must be a multiple of 16 (8 bytes a step of int4_dot) and divide in. Returns 0, or 1 when
 * the scratch copy of x cannot be allocated. */
int int4_matvec(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero,
                 float *y, int rows, int out, int in, int group, int threads) {
    int half = in / 2, groups = in / group;
    /* x split once into even and odd elements, and its sum over each group */
    float *xe = (float *)malloc(sizeof(float) * (size_t)rows * (in + groups));  /* (a cast C++ needs: matvec_ops.cpp) */
    if (xe == NULL) return 1;
    float *xo = xe + (size_t)rows * half, *xsum = xo + (size_t)rows * half;
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < half; j++) {
            xe[r * half + j] = x[(int64_t)r * in + 2 * j];
            xo[r * half + j] = x[(int64_t)r * in + 2 * j + 1];
        }
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int i = g * group; i < (g + 1) * group; i++) s += x[(int64_t)r * in + i];
            xsum[r * groups + g] = s;
        }
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int r = 0; r < rows; r++)
            y[(int64_t)r * out + o] = int4_dot(packed + (int64_t)o * half, scale + (int64_t)o * groups,
                                               zero + (int64_t)o * groups, xe + r * half, xo + r * half,
                                               xsum + r * groups, groups, group / 2);
    free(xe);
    return 0;
}

/* ŵ[o, i] = (q[o, i] - zero[o, g]) · scale[o, g] for every weight: the float matrix prefill
 * multiplies (many rows: a float product beats re-reading codes row by row). w: float32 [out, in]. */
void int4_dequantize(const uint8_t *packed, const float *scale, const uint8_t *zero, float *w,
                     int out, int in, int group, int threads) {
    int half = in / 2, groups = in / group;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int g = 0; g < groups; g++) {
            float s = scale[(int64_t)o * groups + g], offset = -s * zero[(int64_t)o * groups + g];
            const uint8_t *b = packed + (int64_t)o * half + g * (group / 2);
            float *wg = w + (int64_t)o * in + g * group;
            for (int j = 0; j < group / 2; j++) {
                wg[2 * j] = s * (float)(b[j] & 15) + offset;
                wg[2 * j + 1] = s * (float)(b[j] >> 4) + offset;
            }
        }
}

/* ŵ[o, i] = q[o, i] · scale[o]: int8's float matrix for prefill. w: float32 [out, in]. */
void int8_dequantize(const int8_t *q, const float *scale, float *w, int out, int in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int i = 0; i < in; i++) w[(int64_t)o * in + i] = scale[o] * (float)q[(int64_t)o * in + i];
}
