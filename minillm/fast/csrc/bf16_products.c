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
 * bf16_rows_matmul  a batch of rows (a serving step's decodes) with AVX512-BF16: x's rows along the vectors' lanes
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
 * fast as MKL's float32 product (BENCHMARKS.md, "Decode products: PyTorch against the C"). The next tile's rows are
 * fetched into the L2 cache a share each step (`next`): on the AMD EPYC SmolLM2-135M's 121 matrices at 1 / 4 / 8
 * rows took 10.7 / 14.0 / 17.4 -> 7.6 / 8.3 / 11.1 ms, the 1.7B shape's at one 22.7 -> 19.4. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *w, const uint16_t *x, const float *xf,
                                                            int n, int G, int R, float sum[4][4], const char *next) {
    int i = 0;
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) sum[k][r] = 0.0f;
#if defined(__AVX512BF16__)
    (void)xf;
    __m512 acc[4][4];
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) acc[k][r] = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        if (next) prefetch_l2(next + 2 * (int64_t)i * G, 64 * G);  /* the next tile's share: this step's lines */
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
    int ahead = rows_ahead(2 * (int64_t)in, 4);  /* (whole tiles, about PREFETCH_AHEAD_BYTES) */
    const char *next = r == 0 && o + ahead + 4 <= out ? (const char *)(wo + (int64_t)ahead * in) : NULL;
    const float *xfr = xf ? xf + (int64_t)r * in : NULL;
    float sum[4][4];
    if (G == 4) {
        switch (R) {  /* G and R constants in each call: its loops unroll */
            case 4: bf16_tile(wo, xr, xfr, in, 4, 4, sum, next); break;
            case 3: bf16_tile(wo, xr, xfr, in, 4, 3, sum, next); break;
            case 2: bf16_tile(wo, xr, xfr, in, 4, 2, sum, next); break;
            default: bf16_tile(wo, xr, xfr, in, 4, 1, sum, next);
        }
    } else {
        for (int k = 0; k < G; k++) {  /* (w's last out % 4 rows, one at a time) */
            float one[4][4];
            bf16_tile(wo + (int64_t)k * in, xr, xfr, in, 1, R, one, NULL);
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

/* -- bf16_rows_matmul: a batch of rows along the lanes, the weight read in place ----------------------------
 *
 * bf16_matvec sums each output along a vector and reduces it at the end; oneDNN's F.linear multiplied SmolLM2-135M's
 * matrices at 32 rows at 224 GFLOP/s on the AMD EPYC (2 cores, whose dot products reach 468), its weights out of
 * cache. Here, as f32_rows_matmul in products.c, x's rows lie along the lanes: x is copied once a call into pairs
 * xp[p][r] = (x[r, 2p], x[r, 2p + 1]) (rows padded to a block of 16 or 32), and each pair of a weight row, read where
 * it lies, is broadcast to the lanes:
 *
 *   acc[g][v] += dpbf16(w[o0 + g, 2p .. 2p + 1] broadcast, xp[p][16v .. 16v + 15])    (ROWS_TILE_OUTS outputs)
 *
 * every multiply-add useful, nothing reduced across lanes. A tile's ROWS_TILE_OUTS rows of w are ROWS_TILE_OUTS
 * streams from memory, which the CPU's prefetcher followed too late: the next tile's rows (contiguous) are fetched a
 * share each step, which took the 121 matrices at 32 rows from 25.4 to 20.5 ms (30.3 for F.linear). Threads split
 * the outputs. The sums are float32, y rounded once; the pairs' products add in pairs (the reference's order
 * otherwise). */
#define ROWS_TILE_OUTS 8  /* outputs a tile: 16 vector sums at two vectors of rows */

#if defined(__AVX512BF16__)
/* y[r0 .. r0 + 16V, o0 .. o0 + G) (rows < rows only), inlined with V and G constants; `next`: the bytes to fetch
 * while it runs (NULL: none) */
static inline __attribute__((always_inline)) void bf16_rows_tile(const uint32_t *xp, int padded, int r0, int rows,
                                                                 const uint16_t *w, int in, int o0, int G, int V,
                                                                 uint16_t *y, int out, const char *next) {
    __m512 acc[ROWS_TILE_OUTS][2];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < V; v++) acc[g][v] = _mm512_setzero_ps();
    const uint16_t *wo = w + (int64_t)o0 * in;
    for (int p = 0; p < in / 2; p++) {
        prefetch_share(next, (int64_t)p * 4 * G, 4 * G);
        __m512bh xv[2];
        for (int v = 0; v < V; v++) xv[v] = (__m512bh)_mm512_loadu_si512(xp + (int64_t)p * padded + r0 + 16 * v);
        for (int g = 0; g < G; g++) {
            int pair;  /* (memcpy: GCC 12 sent a cast load of a bfloat16 vector through the stack) */
            memcpy(&pair, wo + (int64_t)g * in + 2 * p, 4);
            __m512bh wb = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < V; v++) acc[g][v] = _mm512_dpbf16_ps(acc[g][v], wb, xv[v]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < V; v++) {
            float lanes[16];
            _mm512_storeu_ps(lanes, acc[g][v]);
            for (int l = 0, r = r0 + 16 * v; l < 16 && r + l < rows; l++)
                y[(int64_t)(r + l) * out + o0 + g] = f32_to_bf16(lanes[l]);
        }
}
#endif

/* y [rows, out] = x [rows, in] @ wᵀ, in even. Returns 0; 1 when x's copy in pairs cannot be allocated; 2 where the
 * build has no AVX512-BF16 (bf16_dot_instructions() == 0). */
int bf16_rows_matmul(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int out, int in, int threads) {
#if defined(__AVX512BF16__)
    int V = rows <= 16 ? 1 : 2, block = 16 * V, padded = (rows + block - 1) / block * block;
    int tiles = (out + ROWS_TILE_OUTS - 1) / ROWS_TILE_OUTS;
    uint32_t *xp = aligned_alloc(64, (sizeof(uint32_t) * (size_t)(in / 2) * padded / 64 + 1) * 64);
    if (xp == NULL) return 1;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int p = 0; p < in / 2; p++)
            for (int r = 0; r < padded; r++) {
                uint32_t pair = 0;
                if (r < rows) memcpy(&pair, x + (int64_t)r * in + 2 * p, 4);
                xp[(int64_t)p * padded + r] = pair;
            }
        #pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int o0 = t * ROWS_TILE_OUTS, G = out - o0 < ROWS_TILE_OUTS ? out - o0 : ROWS_TILE_OUTS;
            const char *next = t + 1 < tiles ? (const char *)(w + (int64_t)(o0 + G) * in) : NULL;
            for (int r0 = 0; r0 < rows; r0 += block, next = NULL) {  /* (the next tile fetched once) */
                if (G == ROWS_TILE_OUTS && V == 2) bf16_rows_tile(xp, padded, r0, rows, w, in, o0, G, 2, y, out, next);
                else if (G == ROWS_TILE_OUTS) bf16_rows_tile(xp, padded, r0, rows, w, in, o0, G, 1, y, out, next);
                else
                    for (int g = 0; g < G; g++) bf16_rows_tile(xp, padded, r0, rows, w, in, o0 + g, 1, V, y, out, NULL);
            }
        }
    }
    free(xp);
    return 0;
#else
    (void)x, (void)w, (void)y, (void)rows, (void)out, (void)in, (void)threads;
    return 2;
#endif
}
