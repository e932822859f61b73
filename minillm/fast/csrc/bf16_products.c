/* bfloat16 products for a few rows: y = x @ wᵀ, a bfloat16 model's decode step (1 row a sequence) and
 * verify pass (1 + k rows).
 *
 *   x bfloat16 [rows, in],  w bfloat16 [out, in] (row-major, nn.Linear's layout),  y bfloat16 [rows, out]
 *
 * A bfloat16 is the high half of a float32's bits (uint16_t here), so widening one is a 16-bit shift,
 * exact. Each product of two bfloat16s is exact in float32 (8 + 8 significant bits); the sums are float32
 * and y is rounded to bfloat16 once, at the end (to nearest even), as F.linear in bfloat16 does.
 *
 * bf16_matvec       a few rows: each thread a share of w's rows, four at a time, each weight read once for all rows
 *
 * Why C: F.linear's bfloat16 product of one row streamed 13.7 GB/s where this loop streams 19.0 on the Intel
 * Xeon's two cores (1.7B shape); oneDNN's product on a packed weight is as fast (18.4) but needs a packed copy of
 * every matrix (BENCHMARKS.md, "bfloat16: decode and serving"). From 2 rows the multiply-adds bound this loop
 * and F.linear is faster: minillm.fast.products.few_rows_kernel sends it one row only. It computes
 * bf16_matmul_reference's sums in another order: tests/fast/test_bf16_products.py checks both, native and
 * portable builds, against float64 F.linear.
 */
#include "common.h"

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

int bf16_dot_instructions(void) {  /* 1 where the loop below runs _mm512_dpbf16_ps */
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* sum[k][r] = Σ_i w[k·n + i]·x[r·n + i] for G <= 4 rows of w and R <= 4 rows of x (xf: x widened to float32,
 * read where no dpbf16): each weight vector loaded once for R multiply-adds, each x vector once for G (inlined
 * with G and R constants). Four rows of w at a time are four streams from memory in flight at once: one row at a
 * time (and a software prefetch) streamed 14 GB/s on the Intel Xeon's two cores where four streamed 19-22, as
 * fast as MKL's float32 product (BENCHMARKS.md, "Decode products: PyTorch against the C"). */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *w, const uint16_t *x, const float *xf,
                                                            int n, int G, int R, float sum[4][4]) {
    int i = 0;
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) sum[k][r] = 0.0f;
#if defined(__AVX512BF16__)
    (void)xf;
    __m512 acc[4][4];
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) acc[k][r] = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        __m512bh xv[4];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512(x + (int64_t)r * n + i);
        for (int k = 0; k < G; k++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (int64_t)k * n + i);
            for (int r = 0; r < R; r++) acc[k][r] = _mm512_dpbf16_ps(acc[k][r], xv[r], wv);
        }
    }
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) sum[k][r] = _mm512_reduce_add_ps(acc[k][r]);
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++)
            for (int j = i; j < n; j++) sum[k][r] += bf16_to_f32(w[(int64_t)k * n + j]) * bf16_to_f32(x[(int64_t)r * n + j]);
#else
    (void)x;
    vecf acc[4][4];
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) acc[k][r] = (vecf){0};
    for (; i + VEC <= n; i += VEC) {
        vecf xv[4];
        for (int r = 0; r < R; r++) xv[r] = load_vec(xf + (int64_t)r * n + i);
        for (int k = 0; k < G; k++) {
            vecf wv = widen_vec(w + (int64_t)k * n + i);
            for (int r = 0; r < R; r++) acc[k][r] += wv * xv[r];
        }
    }
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) sum[k][r] = vec_sum(acc[k][r]);
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++)
            for (int j = i; j < n; j++) sum[k][r] += bf16_to_f32(w[(int64_t)k * n + j]) * xf[(int64_t)r * n + j];
#endif
}

/* One tile of y: rows o..o+G of w by rows r..r+R of x (G 4, or fewer at w's end). */
static void bf16_tile_at(const uint16_t *x, const float *xf, const uint16_t *w, uint16_t *y, int o, int r, int G,
                         int R, int out, int in) {
    const uint16_t *wo = w + (int64_t)o * in, *xr = x + (int64_t)r * in;
    const float *xfr = xf ? xf + (int64_t)r * in : NULL;
    float sum[4][4];
    if (G == 4) {
        switch (R) {  /* G and R constants in each call: its loops unroll */
            case 4: bf16_tile(wo, xr, xfr, in, 4, 4, sum); break;
            case 3: bf16_tile(wo, xr, xfr, in, 4, 3, sum); break;
            case 2: bf16_tile(wo, xr, xfr, in, 4, 2, sum); break;
            default: bf16_tile(wo, xr, xfr, in, 4, 1, sum);
        }
    } else {
        for (int k = 0; k < G; k++) {  /* (w's last out % 4 rows, one at a time) */
            float one[4][4];
            bf16_tile(wo + (int64_t)k * in, xr, xfr, in, 1, R, one);
            for (int j = 0; j < R; j++) sum[k][j] = one[0][j];
        }
    }
    for (int k = 0; k < G; k++)
        for (int j = 0; j < R; j++) y[(int64_t)(r + j) * out + o + k] = f32_to_bf16(sum[k][j]);
}

/* The bfloat16 product of a decode step or a verify pass: threads split w's rows, four at a time, each tile of
 * 4 rows of w by up to 4 rows of x. Returns 0, or 1 when the scratch copy of x (no dpbf16) cannot be allocated. */
int bf16_matvec(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int out, int in, int threads) {
    float *xf = NULL;
#if !defined(__AVX512BF16__)
    xf = malloc(sizeof(float) * (size_t)rows * (size_t)in + 1);
    if (!xf) return 1;
    for (int64_t k = 0; k < (int64_t)rows * in; k++) xf[k] = bf16_to_f32(x[k]);
#endif
    int tiles = (out + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        int o = 4 * t, G = out - o < 4 ? out - o : 4;
        for (int r = 0; r < rows; r += 4) bf16_tile_at(x, xf, w, y, o, r, G, rows - r < 4 ? rows - r : 4, out, in);
    }
    free(xf);
    return 0;
}
