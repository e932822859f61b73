/* bfloat16 products for a few rows: y = x @ wᵀ, a bfloat16 model's decode step (1 row a sequence) and
 * verify pass (1 + k rows).
 *
 *   x bfloat16 [rows, in],  w bfloat16 [out, in] (row-major, nn.Linear's layout),  y bfloat16 [rows, out]
 *
 * A bfloat16 is the high half of a float32's bits (uint16_t here), so widening one is a 16-bit shift,
 * exact. Each product of two bfloat16s is exact in float32 (8 + 8 significant bits); the sums are float32
 * and y is rounded to bfloat16 once, at the end (to nearest even), as F.linear in bfloat16 does.
 *
 * bf16_matvec       a few rows: each thread a share of w's rows, each weight read once for all rows
 *
 * Why C: F.linear's bfloat16 product of one row took 1.13-1.41x this loop's time on the Intel Xeon (one
 * thread); oneDNN's product on a packed weight is as fast but needs a packed copy of every matrix
 * (BENCHMARKS.md, "Decode products: PyTorch against the C"). From 4 rows the multiply-adds bound this loop
 * and F.linear is faster: minillm.fast.products.few_rows_kernel sends it one row only. This loop is
 * f32_matvec's (products.c) on half the bytes. It computes bf16_matmul_reference's sums in another order:
 * tests/fast/test_bf16_products.py checks both, native and portable builds, against float64 F.linear.
 */
#include "common.h"

static inline float bf16_to_f32(uint16_t b) {  /* exact: the bits become a float32's high half */
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

/* The scalar reference: y[r, o] = bf16(Σ_i x[r, i] · w[o, i]), the sum in float32. */
void bf16_matmul_reference(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int out, int in) {
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < out; o++) {
            float sum = 0.0f;
            for (int i = 0; i < in; i++) sum += bf16_to_f32(x[(int64_t)r * in + i]) * bf16_to_f32(w[(int64_t)o * in + i]);
            y[(int64_t)r * out + o] = f32_to_bf16(sum);
        }
}

/* -- bf16_matvec: a few rows, each weight read once -------------------------------------------------
 *
 * Two inner loops, by what the CPU has:
 *
 * - AVX512-BF16 (Intel Cooper Lake and later, AMD Zen 4): _mm512_dpbf16_ps multiplies 32 bfloat16 pairs
 *   and adds each two neighbours' products into 16 float32 sums, x read as bfloat16 as it is;
 * - elsewhere (the portable build too): VEC weights widened to float32 by the shift (the compiler's
 *   vectors, so one source serves AVX-512, AVX2 and plain x86-64) and multiplied with x widened once a
 *   call into a float32 scratch copy.
 */

typedef uint16_t vech __attribute__((vector_size(VEC * 2)));
typedef uint32_t vecu __attribute__((vector_size(VEC * 4)));

static inline vecf widen_vec(const uint16_t *p) {  /* VEC bfloat16s -> VEC float32s */
    vech h;
    memcpy(&h, p, sizeof h);
    return (vecf)(__builtin_convertvector(h, vecu) << 16);
}

int bf16_dot_instructions(void) {  /* 1 where the loop below runs _mm512_dpbf16_ps */
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* sum[r] = Σ_i w[i]·x[r·n + i] for R <= 4 rows (xf: x widened to float32, read where no dpbf16), each
 * weight vector loaded once for R multiply-adds, two vector sums a row (inlined with R a constant). */
static inline __attribute__((always_inline)) void bf16_dots(const uint16_t *w, const uint16_t *x, const float *xf,
                                                            int n, int R, float *sum) {
    int i = 0;
    for (int r = 0; r < R; r++) sum[r] = 0.0f;
#if defined(__AVX512BF16__)
    (void)xf;
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_loadu_si512(x + r * n + i), w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_loadu_si512(x + r * n + i + 32), w1);
        }
    }
    for (int r = 0; r < R; r++) sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    for (int r = 0; r < R; r++)
        for (int j = i; j < n; j++) sum[r] += bf16_to_f32(w[j]) * bf16_to_f32(x[r * n + j]);
#else
    (void)x;
    vecf acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (vecf){0};
    for (; i + 2 * VEC <= n; i += 2 * VEC) {
        vecf w0 = widen_vec(w + i), w1 = widen_vec(w + i + VEC);
        for (int r = 0; r < R; r++) {
            acc[r][0] += w0 * load_vec(xf + r * n + i);
            acc[r][1] += w1 * load_vec(xf + r * n + i + VEC);
        }
    }
    for (int r = 0; r < R; r++) sum[r] = vec_sum(acc[r][0] + acc[r][1]);
    for (int r = 0; r < R; r++)
        for (int j = i; j < n; j++) sum[r] += bf16_to_f32(w[j]) * xf[r * n + j];
#endif
}

#define BF16_PREFETCH_ROWS 8  /* f32_matvec's 4 rows ahead, in bytes: a bfloat16 row is half as long */

/* The bfloat16 product of a decode step or a verify pass, as f32_matvec: threads split w's rows, each
 * prefetching the row BF16_PREFETCH_ROWS ahead. Returns 0, or 1 when the scratch copy of x (no dpbf16) cannot
 * be allocated. */
int bf16_matvec(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int out, int in, int threads) {
    float *xf = NULL;
#if !defined(__AVX512BF16__)
    xf = malloc(sizeof(float) * (size_t)rows * (size_t)in + 1);
    if (!xf) return 1;
    for (int64_t k = 0; k < (int64_t)rows * in; k++) xf[k] = bf16_to_f32(x[k]);
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++) {
        const uint16_t *wo = w + (int64_t)o * in;
        if (o + BF16_PREFETCH_ROWS < out)
            prefetch_bytes(wo + (int64_t)BF16_PREFETCH_ROWS * in, (int64_t)in * 2);
        for (int r = 0; r < rows; r += 4) {
            const uint16_t *xr = x + (int64_t)r * in;
            const float *xfr = xf ? xf + (int64_t)r * in : NULL;
            float sum[4];
            int R = rows - r < 4 ? rows - r : 4;
            switch (R) {  /* R a constant in each call: its loops unroll */
                case 4: bf16_dots(wo, xr, xfr, in, 4, sum); break;
                case 3: bf16_dots(wo, xr, xfr, in, 3, sum); break;
                case 2: bf16_dots(wo, xr, xfr, in, 2, sum); break;
                default: bf16_dots(wo, xr, xfr, in, 1, sum);
            }
            for (int k = 0; k < R; k++) y[(int64_t)(r + k) * out + o] = f32_to_bf16(sum[k]);
        }
    }
    free(xf);
    return 0;
}
