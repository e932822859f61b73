/* What the kernel families share: the vector type, the panel micro-kernel's shape, prefetching, and a
 * vector exp. Each family is one file beside this one (products.c, quantized.c, attention.c, rms_norm.c,
 * silu_mul.c), compiled together into one library by minillm/fast/kernels.py; ops.cpp includes them
 * (as C++) to make torch ops of a few.
 *
 * The vectors are the compiler's (GCC/Clang vector extensions): VEC floats, 16 with AVX-512, 8 with
 * AVX, 4 otherwise, so one source serves every CPU; the AVX2/AVX-512 intrinsics appear only where the
 * compiler's own code was measured slower (each place says by how much).
 */
#ifndef MINILLM_COMMON_H
#define MINILLM_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {  /* the sum of 8 lanes: halves added, then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(__AVX512F__)
#define VEC 16
#elif defined(__AVX__)
#define VEC 8
#else
#define VEC 4
#endif
typedef float vecf __attribute__((vector_size(VEC * 4)));

static inline vecf load_vec(const float *p) {
    vecf v;
    memcpy(&v, p, sizeof v);  /* an unaligned load */
    return v;
}

static inline void store_vec(float *p, vecf v) { memcpy(p, &v, sizeof v); }

static inline float vec_sum(vecf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__) && defined(__FMA__)
    return hsum((__m256)v);
#else
    float s = 0.0f;
    for (int l = 0; l < VEC; l++) s += v[l];
    return s;
#endif
}

/* bfloat16, the high half of a float32's bits (uint16_t here): widening one is a 16-bit shift, exact
 * (bf16_products.c, attention.c's bfloat16 pools, rms_norm.c's bfloat16 rows). */
static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even (torch's rounding); NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

typedef uint16_t vech __attribute__((vector_size(VEC * 2)));
typedef uint32_t vecu __attribute__((vector_size(VEC * 4)));

static inline vecf widen_vec(const uint16_t *p) {  /* VEC bfloat16s -> VEC float32s */
    vech h;
    memcpy(&h, p, sizeof h);
    return (vecf)(__builtin_convertvector(h, vecu) << 16);
}

/* The bfloat16 bits of VEC float32s, rounded to nearest even (f32_to_bf16 on every lane, NaN kept quiet) */
static inline vecu bf16_bits(vecf x) {
    vecu u;
    memcpy(&u, &x, sizeof u);
    vecu nan = (vecu)((u & 0x7fffffffu) > 0x7f800000u);  /* all ones where NaN */
    return (nan & ((u >> 16) | 0x40u)) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
}

#if defined(__AVX512BF16__) && VEC == 16
/* With AVX512-BF16 one instruction rounds 16 lanes to nearest even, the same bits as bf16_bits but for a subnormal
 * float32 (below 2^-126 in magnitude), which it reads as zero. 512 rows of 576 (2 threads, 2026-12-05): rms_norm_bf16
 * with the add 150 -> 90 us, rope's 9 + 3 heads 133 -> 88 us. */
static inline vecf round_to_bf16(vecf x) {  /* x rounded to bfloat16, kept in float32 */
    __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    return (vecf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

static inline void store_bf16(uint16_t *p, vecf x) {  /* VEC float32s rounded to bfloat16, stored */
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)x));
}
#else
static inline vecf round_to_bf16(vecf x) {  /* x rounded to bfloat16, kept in float32 */
    vecf r;
    vecu bits = bf16_bits(x) << 16;
    memcpy(&r, &bits, sizeof r);
    return r;
}

static inline void store_bf16(uint16_t *p, vecf x) {  /* VEC float32s rounded to bfloat16, stored */
    vech h = __builtin_convertvector(bf16_bits(x), vech);
    memcpy(p, &h, sizeof h);
}
#endif

static inline void widen_bf16(const uint16_t *src, float *dst, int64_t n) {  /* dst[0:n] = src[0:n], widened */
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) store_vec(dst + i, widen_vec(src + i));
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* The panel micro-kernel (products.c): PANEL outputs a panel, as two vectors; PANEL_ROWS rows of x a
 * block, 2 · PANEL_ROWS vector sums in registers (AVX-512 has 32, AVX2 16). */
#if defined(__AVX512F__)
#define PANEL_ROWS 12
#else
#define PANEL_ROWS 6
#endif
#define PANEL (2 * VEC)

/* y[r·y_stride + l] (+)= Σ_i x[r·x_stride + i] · panel[i·panel_stride + l] for R rows, l < valid
 * (products.c; causal_attention multiplies its queries by keys and its probabilities by values with it) */
void f32_panel_block(const float *x, int64_t x_stride, const float *panel, int64_t panel_stride, int in, int R,
                     float *y, int64_t y_stride, int valid, int add, const char *next, int every);

/* y[r·y_stride + l] = acc[r][l / VEC][l % VEC] for r < R, l < valid */
static inline __attribute__((always_inline)) void store_rows(vecf acc[PANEL_ROWS][2], int R, float *y,
                                                             int64_t y_stride, int valid) {
    for (int r = 0; r < R; r++) {
        float *yr = y + (int64_t)r * y_stride, last[PANEL];
        store_vec(valid == PANEL ? yr : last, acc[r][0]);
        store_vec(valid == PANEL ? yr + VEC : last + VEC, acc[r][1]);
        if (valid < PANEL) memcpy(yr, last, sizeof(float) * valid);
    }
}

/* How far ahead a one-row product fetches its matrix: about this many bytes past the rows it multiplies, into the
 * L2 cache. A group of SmolLM2-135M's 576-column rows is 2-5 KB, too near to cover the memory's latency; a 1.7B-shape
 * group (2,048 columns) fetches the next. On the AMD EPYC, SmolLM2-135M's bfloat16 decode step: 9.9-10.5 ms against
 * 10.3-11.6 with the next group at 128 positions; its 121 int8 products, out of cache: 4.4-4.7 ms against 6.3-6.9
 * with the next group into L1 (BENCHMARKS.md, "A decode step replayed" and "int8 at one row, fetched ahead"). */
#define PREFETCH_AHEAD_BYTES 16384

/* The rows to fetch ahead of a group of `group` rows of `row_bytes` each: whole groups, at least one. */
static inline int rows_ahead(int64_t row_bytes, int group) {
    int64_t groups = PREFETCH_AHEAD_BYTES / (group * row_bytes);
    return (int)(groups > 1 ? groups : 1) * group;
}

static inline void prefetch_bytes(const void *p, int64_t n) {  /* each 64-byte line of p[0:n], into the caches */
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch((const char *)p + b);
}

/* A loop that reads `share` bytes of its own a step fetches as many of the next tile's (`next`, NULL: none): at the
 * step whose share starts at byte `at`, the line it starts (when it starts one). */
static inline void prefetch_share(const char *next, int64_t at, int64_t share) {
    if (next && at % 64 < share) __builtin_prefetch(next + at - at % 64);
}

static inline void prefetch_l2(const void *p, int64_t n) {  /* each 64-byte line of p[0:n], into the L2 cache */
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch((const char *)p + b, 0, 2);
}

/* One step of a micro-kernel's spread prefetch: every `every` steps (0: never), the 128 bytes at *next,
 * then *next moves on by `step` bytes. */
static inline __attribute__((always_inline)) void prefetch_every(int *wait, int every, const char **next,
                                                                 int64_t step) {
    if (every && --*wait == 0) {  /* (a counter: a division a step cost more than the prefetch saves) */
        *wait = every;
        __builtin_prefetch(*next, 0, 2);
        __builtin_prefetch(*next + 64, 0, 2);
        *next += step;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp of 8 lanes, x <= 0 (a score minus the maximum): x = n·ln2 + r with |r| <= ln2/2, exp(r) by
 * Cephes' degree-6 polynomial (~1 ulp, as expf), 2^n put into the exponent bits. Below -87 (where exp
 * leaves float32's normal range) it gives 0: ~1e-38 there instead weighed a key 1,000 below the maximum,
 * whose value was 3e38, at 75 times the right answer (a new user's trial).
 * A NaN stays NaN (max_ps returns its second operand when one is NaN), as in SDPA: a NaN or an
 * infinite key makes its heads' output NaN, not a plausible number. */
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};  /* Cephes' expf, highest power first */

static inline __m256 exp8(__m256 x) {
    __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);  /* (false for a NaN: it stays NaN) */
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts: n·ln2's high part exact */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[k]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(low, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}
#endif

#if defined(__AVX512F__)
/* exp8's polynomial on 16 lanes; 2^n by scalef (the same values) */
static inline __m512 exp16(__m512 x) {
    __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < 6; k++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[k]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(~low, _mm512_scalef_ps(p, n));
}

/* r[i] <- column i of the 16x16 matrix whose rows are r[0..15]: pairs, then quads, then 128-bit lanes swapped
 * (three rounds of 16 shuffles). A finished accumulator tile holds outputs by rows; y wants rows by outputs. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
}
#endif

#endif
