/* Float32 products for a few rows: y = x @ wᵀ, a decode step's (1 row a sequence), a verify pass's
 * (1 + k rows) and a serving step's (a row a sequence).
 *
 *   x float32 [rows, in],  w float32 [out, in] (row-major, nn.Linear's layout),  y float32 [rows, out]
 *
 * f32_matvec       up to 8 rows: each thread a share of w's rows, four at a time, each weight read once for all rows
 * f32_panel_matmul more rows (a server's): a GEMM micro-kernel on a copy of w packed into panels
 * f32_rows_matmul  more rows, w in place: x's rows along a vector's lanes, each weight broadcast to them
 *
 * Each computes f32_matmul_reference's sums, in another order: tests/fast/test_matvec_kernels.py checks them,
 * native and portable builds, against float64 F.linear, and this reference against it too.
 */
#include "common.h"

/* The scalar reference: y[r, o] = Σ_i x[r, i] · w[o, i]. */
void f32_matmul_reference(const float *x, const float *w, float *y, int rows, int out, int in) {
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < out; o++) {
            float sum = 0.0f;
            for (int i = 0; i < in; i++) sum += x[(int64_t)r * in + i] * w[(int64_t)o * in + i];
            y[(int64_t)r * out + o] = sum;
        }
}

/* -- f32_matvec: a few rows, each weight read once --------------------------------------------------- */

/* sum[k][r] = Σ_i w[k·n + i]·x[r·n + i] for G <= 4 rows of w and R <= 4 rows of x: each weight vector loaded
 * once for R multiply-adds, each x vector once for G, G·R vector sums in flight (the compiler's vectors: one
 * source for AVX-512, AVX2 and plain x86-64). Four rows of w at a time are four streams from memory at once:
 * row by row, with a software prefetch 4 rows ahead, SmolLM2-135M's 121 matrices took 35.4-38.7 ms at one row
 * and 50.8-55.6 at 8 (2 threads, Intel Xeon, 2026-12-05); so, 23.6-24.6 and 38.2-40.8, against MKL's 22.4-22.7
 * and 57.4-58.9 (BENCHMARKS.md, "Decode products: PyTorch against the C"). The next tile's rows are fetched into
 * the L2 cache a share each step (`next`; the Intel Xeon measured a prefetch a tile ahead into L1 25 % slower at one
 * row, where MKL runs there): on the AMD EPYC the 121 matrices at 1 / 4 rows 20.2 / 23.2 -> 15.4 / 15.8 ms, the
 * 1.7B shape's 48.5 -> 46.9 at one. Inlined with G and R constants. */
static inline __attribute__((always_inline)) void f32_tile(const float *w, const float *x, int n, int G, int R,
                                                           float sum[4][4], const char *next) {
    vecf acc[4][4];
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) acc[k][r] = (vecf){0};
    int i = 0;
    for (; i + VEC <= n; i += VEC) {
        if (next) prefetch_l2(next + 4 * (int64_t)i * G, 64 * G);  /* the next tile's share: this step's lines */
        vecf xv[4];
        for (int r = 0; r < R; r++) xv[r] = load_vec(x + (int64_t)r * n + i);
        for (int k = 0; k < G; k++) {
            vecf wv = load_vec(w + (int64_t)k * n + i);
            for (int r = 0; r < R; r++) acc[k][r] += wv * xv[r];
        }
    }
    for (int k = 0; k < G; k++)
        for (int r = 0; r < R; r++) {
            sum[k][r] = vec_sum(acc[k][r]);
            for (int j = i; j < n; j++) sum[k][r] += w[(int64_t)k * n + j] * x[(int64_t)r * n + j];
        }
}

/* One tile of y: rows o..o+G of w by rows r..r+R of x (G 4, or fewer at w's end). */
static void f32_tile_at(const float *x, const float *w, float *y, int o, int r, int G, int R, int out, int in) {
    const float *wo = w + (int64_t)o * in, *xr = x + (int64_t)r * in;
    const char *next = r == 0 && o + G + 4 <= out ? (const char *)(wo + (int64_t)G * in) : NULL;
    float sum[4][4];
    if (G == 4) {
        switch (R) {  /* G and R constants in each call: its loops unroll */
            case 4: f32_tile(wo, xr, in, 4, 4, sum, next); break;
            case 3: f32_tile(wo, xr, in, 4, 3, sum, next); break;
            case 2: f32_tile(wo, xr, in, 4, 2, sum, next); break;
            default: f32_tile(wo, xr, in, 4, 1, sum, next);
        }
    } else {
        for (int k = 0; k < G; k++) {  /* (w's last out % 4 rows, one at a time) */
            float one[4][4];
            f32_tile(wo + (int64_t)k * in, xr, in, 1, R, one, NULL);
            for (int j = 0; j < R; j++) sum[k][j] = one[0][j];
        }
    }
    for (int k = 0; k < G; k++)
        for (int j = 0; j < R; j++) y[(int64_t)(r + j) * out + o + k] = sum[k][j];
}

/* The float32 product of a decode step or a verify pass: MKL's product of a few rows runs on one core, which
 * cannot stream memory as fast as all of them (minillm.fast.products says more). Threads split w's rows, four
 * at a time, each tile of 4 rows of w by up to 4 rows of x. */
void f32_matvec(const float *x, const float *w, float *y, int rows, int out, int in, int threads) {
    int tiles = (out + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        int o = 4 * t, G = out - o < 4 ? out - o : 4;
        for (int r = 0; r < rows; r += 4) f32_tile_at(x, w, y, o, r, G, rows - r < 4 ? rows - r : 4, out, in);
    }
}

/* -- f32_panel_matmul: a batch of rows (a serving step's decodes, a short prefill chunk) ---------------
 *
 * A GEMM micro-kernel, the loop BLIS and oneDNN are built around (Goto and van de Geijn 2008, "Anatomy
 * of high-performance matrix multiplication"), on a copy of the matrix packed once into panels of
 * PANEL outputs, each panel's weights column by column:
 *
 *   packed[p, i, l] = w[p·PANEL + l, i]          (zeros past `out`)
 *
 *   y[r, p·PANEL : (p+1)·PANEL] = Σ_i x[r, i] · packed[p, i, :]
 *
 * so each step of i loads PANEL weights as two vectors and multiplies them by one x[r, i] broadcast
 * for every row r of a block: 2 · R vector sums stay in registers the whole loop (R = PANEL_ROWS:
 * 2 x 12 of AVX-512's 32 registers, 2 x 6 of AVX2's 16), the results go straight to y, and no lane
 * is ever summed across. Threads split the panels; a panel (PANEL · in floats: 72 KiB at in = 576)
 * is read from memory once and from L2 for the row blocks after the first.
 *
 * Reading the matrix is still the floor (decode's rows are few), so while a thread computes a panel it
 * prefetches the next one into L2, a row (two lines) every `blocks` steps: spread over all the row
 * blocks, not in one burst (measured, SmolLM2-135M's 120 decoder matrices out of cache, 2 threads, Intel
 * Xeon, 2026-12-03, ms for all, panels / oneDNN's packed product / f32_matvec):
 *
 *   rows         1     8    16    32    40   128   256   512
 *   panels     14.9  20.0  22.1  26.9  29.6  72.9  143   285
 *   oneDNN     21.2  26.0  31.0  38.9  43.1  91.4  151   278    (F.linear at 512: 279)
 *   f32_matvec 17.9  24.4  39.3  76.2
 *
 * The sum over i runs in order, one term at a time per output (not as vector partial sums): float
 * rounding grows like √in·ε, as in the reference. */

int f32_panel_width(void) { return PANEL; }

/* packed [ceil(out / PANEL), in, PANEL] from w [out, in] */
void f32_pack_panels(const float *w, float *packed, int out, int in, int threads) {
    int panels = (out + PANEL - 1) / PANEL;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < panels; p++)
        for (int i = 0; i < in; i++)
            for (int l = 0; l < PANEL; l++) {
                int64_t o = (int64_t)p * PANEL + l;
                packed[((int64_t)p * in + i) * PANEL + l] = o < out ? w[o * in + i] : 0.0f;
            }
}

/* y[r·y_stride + l] (+)= Σ_i x[r·x_stride + i] · panel[i·panel_stride + l], l < valid, for R <= PANEL_ROWS
 * rows of x and a panel of PANEL columns (inlined with R a constant: its loops unroll and the sums get
 * registers); `add`: y's values are added to (valid == PANEL only). With every > 0, prefetches a row of
 * `next` every `every` steps. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_stride, const float *panel,
                                                             int64_t panel_stride, int in, int R, float *y,
                                                             int64_t y_stride, int valid, int add,
                                                             const char *next, int every) {
    vecf acc[PANEL_ROWS][2];
    memset(acc, 0, sizeof acc);
    for (int r = 0; add && r < R; r++) {
        acc[r][0] = load_vec(y + (int64_t)r * y_stride);
        acc[r][1] = load_vec(y + (int64_t)r * y_stride + VEC);
    }
    int wait = every;
    for (int i = 0; i < in; i++) {
        const float *w = panel + (int64_t)i * panel_stride;
        vecf w0 = load_vec(w), w1 = load_vec(w + VEC);
        for (int r = 0; r < R; r++) {
            float xr = x[(int64_t)r * x_stride + i];
            acc[r][0] += w0 * xr;
            acc[r][1] += w1 * xr;
        }
        prefetch_every(&wait, every, &next, PANEL * 4);
    }
    store_rows(acc, R, y, y_stride, valid);
}

/* panel_rows for any R in 1..PANEL_ROWS: a constant in each call */
void f32_panel_block(const float *x, int64_t x_stride, const float *panel, int64_t panel_stride, int in, int R,
                     float *y, int64_t y_stride, int valid, int add, const char *next, int every) {
    switch (R) {
#define ROWS(n) case n: panel_rows(x, x_stride, panel, panel_stride, in, n, y, y_stride, valid, add, next, every); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if PANEL_ROWS > 6
        ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
#undef ROWS
    }
}

/* y [rows, out] = x [rows, in] @ wᵀ, w given as f32_pack_panels' copy. */
void f32_panel_matmul(const float *x, const float *packed, float *y, int rows, int out, int in, int threads) {
    int panels = (out + PANEL - 1) / PANEL, blocks = (rows + PANEL_ROWS - 1) / PANEL_ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < panels; p++) {
        const float *panel = packed + (int64_t)p * in * PANEL;
        /* the next panel (the last one re-reads its own: a prefetch must stay inside the copy) */
        const char *next = (const char *)(p + 1 < panels ? panel + (int64_t)in * PANEL : panel);
        int valid = out - p * PANEL < PANEL ? out - p * PANEL : PANEL, done = 0;
        for (int b = 0; b < blocks; b++) {
            int R = (rows - done) / (blocks - b);  /* the rows shared evenly: 16 as 8 + 8, not 12 + 4 */
            const char *share = next + (int64_t)in * PANEL * 4 * b / blocks;  /* this block's share of it */
            f32_panel_block(x + (int64_t)done * in, in, panel, PANEL, in, R,
                            y + (int64_t)done * out + (int64_t)p * PANEL, out, valid, 0, share, blocks);
            done += R;
        }
    }
}

/* -- f32_rows_matmul: a batch of rows (a serving step's decodes), the weight read in place ---------------------
 *
 * f32_matvec's tiles sum each output along a vector and reduce it at the end: at 32 rows that loop and MKL's
 * product both multiplied at ~78 GFLOP/s on the AMD EPYC, 0.4x its float32 peak. Here the rows of x lie along a
 * vector's lanes instead: x is copied transposed once a call (xt[i][r], rows padded to a block of ROW_VECS·VEC),
 * and each weight, read where it lies, is broadcast to the lanes:
 *
 *   acc[g][v] += xt[i][v·VEC .. v·VEC + VEC-1] · w[o0 + g, i]      (TILE_OUTS outputs by a block of rows)
 *
 * so every multiply-add is useful, no sum is reduced across lanes, and the tile's TILE_OUTS rows of w (the outputs'
 * weights, each a stream from memory) stay in the L1 cache for every block of rows; the next tile's rows (contiguous)
 * are fetched a share each step, which the CPU's own prefetcher did too late (SmolLM2-135M's 121 matrices at 8 / 32 /
 * 64 rows 26.7 / 43.9 / 85.2 -> 21.6 / 39.5 / 79.3 ms on the AMD EPYC). The sums run over i in order, one term at a
 * time per output, as the reference's do. Threads split the outputs. */
#define ROW_VECS 2   /* vectors of rows a block, at most: 32 rows with AVX-512 (one vector for up to VEC rows) */
#define TILE_OUTS 8  /* outputs a tile: TILE_OUTS · ROW_VECS vector sums in registers */

/* y[r0 .. r0 + V·VEC, o0 .. o0 + G) (rows < rows only), inlined with V and G constants */
static inline __attribute__((always_inline)) void rows_tile(const float *xt, int padded, int r0, int rows,
                                                            const float *w, int in, int o0, int G, int V, float *y,
                                                            int out, const char *next) {
    vecf acc[TILE_OUTS][ROW_VECS];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < V; v++) acc[g][v] = (vecf){0};
    const float *wo = w + (int64_t)o0 * in;
    for (int i = 0; i < in; i++) {
        prefetch_share(next, (int64_t)i * 4 * G, 4 * G);
        const float *xi = xt + (int64_t)i * padded + r0;
        vecf xv[ROW_VECS];
        for (int v = 0; v < V; v++) xv[v] = load_vec(xi + v * VEC);
        for (int g = 0; g < G; g++) {
            float wg = wo[(int64_t)g * in + i];
            for (int v = 0; v < V; v++) acc[g][v] += xv[v] * wg;
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < V; v++) {
            float lanes[VEC];
            store_vec(lanes, acc[g][v]);
            for (int l = 0, r = r0 + v * VEC; l < VEC && r + l < rows; l++)
                y[(int64_t)(r + l) * out + o0 + g] = lanes[l];
        }
}

/* y [rows, out] = x [rows, in] @ wᵀ (w row-major, read in place). Returns 0, or 1 when x's transposed copy cannot
 * be allocated. */
int f32_rows_matmul(const float *x, const float *w, float *y, int rows, int out, int in, int threads) {
    int V = rows <= VEC ? 1 : ROW_VECS, block = V * VEC, padded = (rows + block - 1) / block * block;
    int tiles = (out + TILE_OUTS - 1) / TILE_OUTS;
    float *xt = (float *)aligned_alloc(64, (sizeof(float) * (size_t)in * padded / 64 + 1) * 64);  /* (a multiple) */
    if (xt == NULL) return 1;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int i = 0; i < in; i++)
            for (int r = 0; r < padded; r++) xt[(int64_t)i * padded + r] = r < rows ? x[(int64_t)r * in + i] : 0.0f;
        #pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int o0 = t * TILE_OUTS, G = out - o0 < TILE_OUTS ? out - o0 : TILE_OUTS;
            const char *next = t + 1 < tiles ? (const char *)(w + (int64_t)(o0 + G) * in) : NULL;
            for (int r0 = 0; r0 < rows; r0 += block, next = NULL) {  /* (G, V constants in each call: loops unroll) */
                if (G == TILE_OUTS && V == ROW_VECS)
                    rows_tile(xt, padded, r0, rows, w, in, o0, TILE_OUTS, ROW_VECS, y, out, next);
                else if (G == TILE_OUTS) rows_tile(xt, padded, r0, rows, w, in, o0, TILE_OUTS, 1, y, out, next);
                else rows_tile(xt, padded, r0, rows, w, in, o0, G, V, y, out, NULL);
            }
        }
    }
    free(xt);
    return 0;
}
