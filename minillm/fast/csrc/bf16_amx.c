/* bfloat16 products on the CPU's matrix units (Intel AMX), the weight read where it lies: y = x @ wᵀ.
 *
 *   x bfloat16 [rows, in],  w bfloat16 [out, in] (row-major, nn.Linear's layout),  y bfloat16 [rows, out]
 *
 * An AMX tile multiply-add C += A·B takes A as 16 rows of 32 bfloat16s, row-major, which is what 16 rows of
 * w already are; B must be "VNNI" (each pair of neighbouring ks side by side: B[k/2][n][2]). So this file
 * computes the product transposed, yᵀ = w · xᵀ: w is the A operand, read in place at every call, and only x,
 * a step's few rows, is packed into pairs (xb below). oneDNN's F.linear makes w the B operand, and so
 * reorders the whole matrix at every call unless it keeps a packed copy: at a serving step's 1-64 rows that
 * reorder cost more than the product (BENCHMARKS.md, "bfloat16 products on the matrix units").
 *
 *   yᵀ tile [16 outputs, 16 rows] (float32) += w tile [16 outputs, 32 ks] · xb tile [16 k-pairs, 16 rows, 2]
 *
 * Each thread takes blocks of 32 outputs (two A tiles) and walks x's rows 32 at a time (two B tiles): four
 * float32 accumulator tiles, the eight tile registers' usual split. A finished tile is transposed as it is
 * rounded to bfloat16 (to nearest even, as F.linear's) into y's rows. The sums are float32, in another order
 * than F.linear's; tests/fast/test_bf16_amx.py checks them against float64.
 *
 * Built only where the compiler targets AMX-BF16 (-march=native on an Intel Xeon from Sapphire Rapids on);
 * Linux also asks each process to request the tile registers (arch_prctl), which bf16_amx_ready does.
 * Needs in a multiple of 32 and out a multiple of 16 (every SmolLM2, Llama and Qwen matrix); F.linear
 * runs the rest (minillm.fast.products).
 */
#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define BF16_AMX 1
#include "amx.h"

/* x [rows, in] -> xb, block after block of 16 rows: block b, pair p holds x[16b + j][2p], x[16b + j][2p + 1]
 * at j (zeros past the last row). One 32-bit gather per pair reads a pair from each of the 16 rows. */
static void pack_pairs(const uint16_t *x, uint16_t *xb, int rows, int in, int block) {
    int first = 16 * block, n = rows - first < 16 ? rows - first : 16, pairs = in / 2;
    const uint32_t *src = (const uint32_t *)x + (int64_t)first * pairs;
    uint32_t *dst = (uint32_t *)xb + (int64_t)block * pairs * 16;
    __m512i row_starts = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(pairs));
    __mmask16 live = (__mmask16)((1u << n) - 1);
    for (int p = 0; p < pairs; p++)
        _mm512_store_si512(dst + (int64_t)p * 16,
                           _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row_starts, src + p, 4));
}

/* One finished tile, c[i][j] = y[first_row + j][o + i] in float32, plus the bias (float32, or none), rounded once
 * into y (n of its 16 rows are x's). */
static void store_transposed(const float *c, const float *bias, uint16_t *y, int o, int first_row, int n, int out) {
    __m512 r[16], b = bias ? _mm512_loadu_ps(bias + o) : _mm512_setzero_ps();
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c + 16 * i);
    transpose16(r);
    for (int j = 0; j < n; j++)
        _mm256_storeu_si256((__m256i *)(y + (int64_t)(first_row + j) * out + o),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(r[j], b)));
}

/* Outputs o..o+16M by rows 16b..16b+16N (M, N 1 or 2, constants once inlined: tile numbers are immediates).
 * Tiles 0-3 accumulate (0: o, rows; 1: o+16, rows; 2: o, rows+16; 3: o+16, rows+16), 4-5 hold w, 6-7 xb. */
static inline __attribute__((always_inline)) void tile_block(const uint16_t *w, const uint16_t *xb, const float *bias,
                                                             uint16_t *y, int o, int b, int M, int N, int rows, int out,
                                                             int in) {
    const uint16_t *w0 = w + (int64_t)o * in, *w1 = w0 + (int64_t)16 * in;
    const uint16_t *b0 = xb + (int64_t)b * 16 * in, *b1 = b0 + (int64_t)16 * in;
    _tile_zero(0);
    if (M == 2) _tile_zero(1);
    if (N == 2) _tile_zero(2);
    if (M == 2 && N == 2) _tile_zero(3);
    for (int k = 0; k < in; k += 32) {  /* a w tile: 16 rows of 64 bytes, in·2 bytes apart */
        _tile_loadd(4, w0 + k, in * 2);
        _tile_loadd(6, b0 + (int64_t)k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (M == 2) { _tile_loadd(5, w1 + k, in * 2); _tile_dpbf16ps(1, 5, 6); }
        if (N == 2) { _tile_loadd(7, b1 + (int64_t)k * 16, 64); _tile_dpbf16ps(2, 4, 7); }
        if (M == 2 && N == 2) _tile_dpbf16ps(3, 5, 7);
    }
    float c[256] __attribute__((aligned(64)));
    int first = 16 * b, n0 = rows - first < 16 ? rows - first : 16;
    int n1 = rows - first - 16 < 16 ? rows - first - 16 : 16;
    _tile_stored(0, c, 64); store_transposed(c, bias, y, o, first, n0, out);
    if (M == 2) { _tile_stored(1, c, 64); store_transposed(c, bias, y, o + 16, first, n0, out); }
    if (N == 2) { _tile_stored(2, c, 64); store_transposed(c, bias, y, o, first + 16, n1, out); }
    if (M == 2 && N == 2) { _tile_stored(3, c, 64); store_transposed(c, bias, y, o + 16, first + 16, n1, out); }
}

/* Every row block for outputs o..o+16M: pairs of blocks, then the odd one. */
static void output_block(const uint16_t *w, const uint16_t *xb, const float *bias, uint16_t *y, int o, int M, int rows,
                         int out, int in) {
    int blocks = (rows + 15) / 16, b = 0;
    for (; b + 2 <= blocks; b += 2) {
        if (M == 2) tile_block(w, xb, bias, y, o, b, 2, 2, rows, out, in);
        else tile_block(w, xb, bias, y, o, b, 1, 2, rows, out, in);
    }
    if (b < blocks) {
        if (M == 2) tile_block(w, xb, bias, y, o, b, 2, 1, rows, out, in);
        else tile_block(w, xb, bias, y, o, b, 1, 1, rows, out, in);
    }
}
#endif

/* 1 where bf16_amx_matmul runs: built for AMX-BF16 and the tile registers granted to this process. Asks once. */
int bf16_amx_ready(void) {
#if defined(BF16_AMX)
    return amx_granted();
#else
    return 0;
#endif
}

/* y = x @ wᵀ + bias on the tile registers (bias: float32 [out], or NULL; added before the one rounding). Returns 0;
 * 1 when the packed x cannot be allocated; 2 for shapes it does not take (in % 32, out % 16) or where it is not
 * built or granted (bf16_amx_ready() == 0). The caller's tile configuration is put back after: a library that
 * keeps one loaded between its calls (oneDNN, PyTorch's brgemm) finds it as it left it. */
int bf16_amx_matmul(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int rows, int out, int in,
                    int threads) {
#if defined(BF16_AMX)
    if (in % 32 || out % 16 || rows < 1 || !bf16_amx_ready()) return 2;
    int blocks = (rows + 15) / 16, units = (out + 31) / 32;  /* units: 32 outputs (the last may be 16) */
    uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)blocks * 16 * in * 2);
    if (!xb) return 1;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++) pack_pairs(x, xb, rows, in, b);
        tile_config saved;
        amx_configure(&saved);
        #pragma omp for schedule(static)
        for (int u = 0; u < units; u++) output_block(w, xb, bias, y, 32 * u, out - 32 * u >= 32 ? 2 : 1, rows, out, in);
        amx_restore(&saved);
    }
    free(xb);
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)out, (void)in, (void)threads;
    return 2;
#endif
}
