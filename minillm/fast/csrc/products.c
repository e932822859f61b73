/* Float32 products for a few rows: y = x @ wᵀ, a decode step's (1 row a sequence), a verify pass's
 * (1 + k rows) and a serving step's (a row a sequence).
 *
 *   x float32 [rows, in],  w float32 [out, in] (row-major, nn.Linear's layout),  y float32 [rows, out]
 *
 * f32_matvec       up to 8 rows: each thread a share of w's rows, each weight read once for all rows
 * f32_panel_matmul more rows (a server's): a GEMM micro-kernel on a copy of w packed into panels
 *
 * Both compute f32_matmul_reference's sums, in another order: tests/fast/test_matvec_kernels.py checks them,
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

/* Σ_i x[i]·w[i] in float32. AVX2: four vector sums of 8 lanes, so that four multiply-adds are in
 * flight; the loop reads w as fast as the memory delivers it (quantized.c's int8_dot says why four). */
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

#define PREFETCH_ROWS 4

/* The float32 product of a decode step or a verify pass: MKL's product of a few rows runs on one
 * core, which cannot stream memory as fast as all of them (minillm.fast.products says more). Each thread
 * walks its share of the matrix row by row; the CPU's prefetcher alone left the loop waiting on memory
 * (all 120 SmolLM2-135M matrices out of cache, 2 threads, Intel Xeon, 2026-12-03: 1/4/8 rows 19.4/25.3/
 * 30.6 ms), so the row PREFETCH_ROWS ahead is requested while this one computes (17.9/21.1/24.4 ms; 2 or 8
 * rows ahead were slower). */
void f32_matvec(const float *x, const float *w, float *y, int rows, int out, int in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++) {
        const float *wo = w + (int64_t)o * in;
        if (o + PREFETCH_ROWS < out)
            prefetch_bytes(wo + (int64_t)PREFETCH_ROWS * in, (int64_t)in * 4);
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
