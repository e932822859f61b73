/* int8 and int4 products on the CPU's matrix units (Intel AMX-INT8), x kept at float32's precision: y = x @ ŵᵀ
 * with minillm/quantize.py's formats,
 *
 *   int8  ŵ[o, k] = q[o, k] · scale[o]                   q int8 [out, in] (row-major), scale float32 [out]
 *   int4  ŵ[o, k] = (q[o, k] - zero[o, g]) · scale[o, g]  packed uint8 [out, in/2] (byte j = q[2j] | q[2j+1] << 4),
 *         g = k / group                                   scale float32, zero uint8 [out, in/group]
 *
 *   x float32 [rows, in],  y float32 [rows, out]
 *
 * x is written as four int8 digits in base 254 (quantized_digits.h: the digits, their error bound, the rows a
 * scalar loop takes), so a tile's int8 multiply-adds keep float32's precision.
 *
 * As in bf16_amx.c, the codes are the tiles' A operand, 16 rows of 64 int8s, and the product is computed
 * transposed, yᵀ = ŵ · xᵀ. int8 codes are read in place. int4 codes are unpacked into a small buffer (abuf below:
 * 32 rows, q - zero in [-15, 15]), and each group's int32 tile is added into a float32 one times its scales (a
 * group must be whole tiles: group a multiple of 64). x's digits are packed as the B operand ("VNNI": four
 * neighbouring ks side by side, xd below): a B tile's 16 columns hold 4 rows of x, four digits each (column 4c + j:
 * digit c of row j), so one tile multiply serves up to 4 rows:
 *
 *   tile [16 outputs, 16 columns] (int32) += q tile [16 outputs, 64 ks] · xd tile [16 k-quads, 16 columns, 4]
 *
 * Each thread takes blocks of 32 outputs (two A tiles) and walks x's rows 8 at a time (two B tiles). Four digits
 * cost four times the multiply-adds of one, which a decode step's few rows leave the matrix units to spare: int8
 * reads SmolLM2-1.7B's matrices at 23 GB/s of the host's 26.8 (BENCHMARKS.md, "Quantised products on the matrix
 * units"); int4 streams 9 GB/s, its unpacking and per-group sums the bound, so one row of x (a decode step's) with
 * int4 codes runs on the vector units instead (quantized_vnni.c: 15-18 GB/s).
 *
 * Built only where the compiler targets AMX-INT8 (-march=native on an Intel Xeon from Sapphire Rapids on); needs
 * in a multiple of 64 and out a multiple of 16 (every SmolLM2, Llama and Qwen matrix). minillm.fast.products
 * runs csrc/quantized.c's kernels elsewhere.
 */
#include "quantized_digits.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512DQ__) \
    && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__linux__)
#define QUANTIZED_AMX 1
#include "amx.h"

#define ROWS_PER_TILE 4  /* rows of x whose four digits fill a B tile's 16 columns */
#define CHUNK_ROWS 320  /* rows of x digitised at once: 80 B tiles */

/* Block b's B operand: xd + b·16·in bytes, k-quad p, column v = 4c + j <- digits[4b + j][c][4p .. 4p + 3]. One
 * 32-bit gather per quad reads a quad from each of the 16 digit rows (zeros past the last row of x). */
static void pack_quads(const int8_t *digits, int8_t *xd, int rows, int in, int block) {
    int first = ROWS_PER_TILE * block, n = rows - first < ROWS_PER_TILE ? rows - first : ROWS_PER_TILE;
    int quads = in / 4, index[16] = {0};
    __mmask16 live = 0;
    for (int c = 0; c < DIGITS; c++)
        for (int j = 0; j < n; j++) {
            index[ROWS_PER_TILE * c + j] = ((first + j) * DIGITS + c) * quads;
            live |= (__mmask16)(1u << (ROWS_PER_TILE * c + j));
        }
    __m512i starts = _mm512_loadu_si512(index);
    const int32_t *src = (const int32_t *)digits;
    int32_t *dst = (int32_t *)(xd + (int64_t)block * 16 * in);
    for (int p = 0; p < quads; p++)
        _mm512_store_si512(dst + (int64_t)p * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, starts,
                                                                               src + p, 4));
}

/* One finished int8 tile into y's rows first .. first + n - 1 at outputs o .. o + 15: r[i] holds output o + i's 16
 * columns (float32), each row's digits combined, times its scale s (row_s), then scale16[i]. s first: it is a power
 * of two, so exact, where scale16 · s could pass float32's range (scale 1e38, s 16) and the result not. */
static void store_tile(__m512 r[16], const float *scale16, const float *row_s, float *y, int o, int first, int n,
                       int out) {
    __m512 inv = _mm512_set1_ps(1.0f / BASE), sc = _mm512_loadu_ps(scale16);
    transpose16(r);  /* r[v]: column v for the 16 outputs */
    for (int j = 0; j < n; j++) {
        __m512 low = _mm512_fmadd_ps(_mm512_fmadd_ps(r[12 + j], inv, r[8 + j]), inv, r[4 + j]);
        __m512 sum = _mm512_mul_ps(_mm512_fmadd_ps(low, inv, r[j]), _mm512_set1_ps(row_s[first + j]));
        _mm512_storeu_ps(y + (int64_t)(first + j) * out + o, _mm512_mul_ps(sum, sc));
    }
}

/* An int8 tile's sums, c[i][v] for output o + i and column v, into y. */
static void store_int8_tile(const int32_t *c, const float *scale, const float *row_s, float *y, int o, int first,
                            int n, int out) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i));
    store_tile(r, scale + o, row_s, y, o, first, n, out);
}

/* Outputs o..o+16M by blocks b, b+1 (N of them): M, N 1 or 2, constants once inlined (tile numbers are immediates).
 * Tiles 0-3 accumulate (0: o, b; 1: o+16, b; 2: o, b+1; 3: o+16, b+1), 4-5 hold q, 6-7 xd. */
static inline __attribute__((always_inline)) void int8_tile_block(const int8_t *q, const int8_t *xd, const float *scale,
                                                             const float *row_s, float *y, int o,
                                                             int b, int M, int N, int rows, int out, int in) {
    const int8_t *q0 = q + (int64_t)o * in, *q1 = q0 + (int64_t)16 * in;
    const int8_t *b0 = xd + (int64_t)b * 16 * in, *b1 = b0 + (int64_t)16 * in;
    _tile_zero(0);
    if (M == 2) _tile_zero(1);
    if (N == 2) _tile_zero(2);
    if (M == 2 && N == 2) _tile_zero(3);
    for (int k = 0; k < in; k += 64) {  /* a q tile: 16 rows of 64 codes, in bytes apart */
        _tile_loadd(4, q0 + k, in);
        _tile_loadd(6, b0 + (int64_t)k * 16, 64);
        _tile_dpbssd(0, 4, 6);
        if (M == 2) { _tile_loadd(5, q1 + k, in); _tile_dpbssd(1, 5, 6); }
        if (N == 2) { _tile_loadd(7, b1 + (int64_t)k * 16, 64); _tile_dpbssd(2, 4, 7); }
        if (M == 2 && N == 2) _tile_dpbssd(3, 5, 7);
    }
    int32_t c[256] __attribute__((aligned(64)));
    int first = ROWS_PER_TILE * b, n0 = rows - first < ROWS_PER_TILE ? rows - first : ROWS_PER_TILE;
    int second = first + ROWS_PER_TILE, n1 = rows - second < ROWS_PER_TILE ? rows - second : ROWS_PER_TILE;
    _tile_stored(0, c, 64); store_int8_tile(c, scale, row_s, y, o, first, n0, out);
    if (M == 2) { _tile_stored(1, c, 64); store_int8_tile(c, scale, row_s, y, o + 16, first, n0, out); }
    if (N == 2) { _tile_stored(2, c, 64); store_int8_tile(c, scale, row_s, y, o, second, n1, out); }
    if (M == 2 && N == 2) { _tile_stored(3, c, 64); store_int8_tile(c, scale, row_s, y, o + 16, second, n1, out); }
}

/* Every block for outputs o..o+16M: pairs of blocks, then the odd one. */
static void int8_output_block(const int8_t *q, const int8_t *xd, const float *scale,
                         const float *row_s, float *y, int o, int M, int rows, int out, int in) {
    int blocks = (rows + ROWS_PER_TILE - 1) / ROWS_PER_TILE, b = 0;
    for (; b + 2 <= blocks; b += 2) {
        if (M == 2) int8_tile_block(q, xd, scale, row_s, y, o, b, 2, 2, rows, out, in);
        else int8_tile_block(q, xd, scale, row_s, y, o, b, 1, 2, rows, out, in);
    }
    if (b < blocks) {
        if (M == 2) int8_tile_block(q, xd, scale, row_s, y, o, b, 2, 1, rows, out, in);
        else int8_tile_block(q, xd, scale, row_s, y, o, b, 1, 1, rows, out, in);
    }
}

/* -- int4: a group at a time ----------------------------------------------------------------------------------- */

/* abuf[i][k] = q[o + i][k] - zero[o + i][k / group] for the unit's n_out outputs: their codes in int8, the two
 * nibbles of byte j (ks 2j, 2j + 1) side by side, as a 16-bit lane widened from the byte holds them. Whole rows at
 * once: unpacking a group at a time, just before the tiles read it, took SmolLM2-135M's matrices 10.5 ms a row
 * against 8.9. */
static void unpack_rows(const uint8_t *packed, const uint8_t *zero, int8_t *abuf, int o, int n_out, int in,
                        int group) {
    int groups = in / group;
    __m512i low = _mm512_set1_epi16(0x0F), high = _mm512_set1_epi16(0xF0);
    for (int i = 0; i < n_out; i++) {
        const uint8_t *src = packed + (int64_t)(o + i) * (in / 2);
        for (int g = 0; g < groups; g++) {
            __m512i z = _mm512_set1_epi8((char)zero[(int64_t)(o + i) * groups + g]);
            for (int k = g * group; k < (g + 1) * group; k += 64) {
                __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + k / 2)));
                __m512i q = _mm512_or_si512(_mm512_and_si512(w, low), _mm512_slli_epi16(_mm512_and_si512(w, high), 4));
                _mm512_store_si512(abuf + (int64_t)i * in + k, _mm512_sub_epi8(q, z));
            }
        }
    }
}

/* acc[i][v] += scale[o + i][g] · c[i][v] · col_s[v]: a group's int32 tile into the float32 sums, each column times
 * its row's s / 254^c (digit c) first: a column times its scale alone, or a scale times s, can pass float32's range
 * where the result does not (a new user's trials: scale 2e37 with x 1e-20, inf; a lower digit's column times
 * 6.25e32 · 16, inf). */
static void add_scaled(const int32_t *c, const float *scale, const float *col_s, float *acc, int o, int g,
                       int groups) {
    __m512 s = _mm512_loadu_ps(col_s);
    for (int i = 0; i < 16; i++)
        _mm512_store_ps(acc + 16 * i,
                        _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i)), s),
                                        _mm512_set1_ps(scale[(int64_t)(o + i) * groups + g]),
                                        _mm512_load_ps(acc + 16 * i)));
}

/* Group g of outputs o..o+16M by blocks b, b+1 (N of them) into acc (tile (block, half) at acc + (2·block + half)
 * · 256), the codes from abuf, column v of block b times col_s[16b + v]; tiles numbered as in int8_tile_block. */
static inline __attribute__((always_inline)) void group_tiles(const int8_t *abuf, const int8_t *xd, const float *scale,
                                                              const float *col_s, float *acc, int o, int g, int b,
                                                              int M, int N, int in, int group) {
    const int8_t *b0 = xd + (int64_t)b * 16 * in + (int64_t)g * group * 16, *b1 = b0 + (int64_t)16 * in;
    _tile_zero(0);
    if (M == 2) _tile_zero(1);
    if (N == 2) _tile_zero(2);
    if (M == 2 && N == 2) _tile_zero(3);
    for (int t = 0; t < group; t += 64) {
        _tile_loadd(4, abuf + (int64_t)g * group + t, in);
        _tile_loadd(6, b0 + (int64_t)t * 16, 64);
        _tile_dpbssd(0, 4, 6);
        if (M == 2) { _tile_loadd(5, abuf + (int64_t)16 * in + (int64_t)g * group + t, in); _tile_dpbssd(1, 5, 6); }
        if (N == 2) { _tile_loadd(7, b1 + (int64_t)t * 16, 64); _tile_dpbssd(2, 4, 7); }
        if (M == 2 && N == 2) _tile_dpbssd(3, 5, 7);
    }
    int32_t c[256] __attribute__((aligned(64)));
    int groups = in / group;
    const float *s0 = col_s + 16 * b, *s1 = s0 + 16;
    _tile_stored(0, c, 64); add_scaled(c, scale, s0, acc + 512 * b, o, g, groups);
    if (M == 2) { _tile_stored(1, c, 64); add_scaled(c, scale, s0, acc + 512 * b + 256, o + 16, g, groups); }
    if (N == 2) { _tile_stored(2, c, 64); add_scaled(c, scale, s1, acc + 512 * (b + 1), o, g, groups); }
    if (M == 2 && N == 2) {
        _tile_stored(3, c, 64);
        add_scaled(c, scale, s1, acc + 512 * (b + 1) + 256, o + 16, g, groups);
    }
}

/* Outputs o..o+16M for every row of the chunk: their codes unpacked once, then each group for all blocks; then the
 * sums into y. acc: 1024 floats a block, abuf: 32 · in bytes (this thread's). The groups' sums are added 16 at a
 * time, then into a total: added in turn, 2,048 groups' (in = 131,072) missed float32's bound 2.6x on rows of one
 * sign. */
static void int4_unit(const uint8_t *packed, const float *scale, const uint8_t *zero, const int8_t *xd,
                      const float *row_s, float *y, float *acc, int8_t *abuf, int o, int M, int rows, int out, int in,
                      int group) {
    int blocks = (rows + ROWS_PER_TILE - 1) / ROWS_PER_TILE, groups = in / group;
    float *total = acc + 512 * (size_t)blocks, col_s[16 * CHUNK_ROWS / ROWS_PER_TILE];
    for (int v = 0; v < 16 * blocks; v++) {  /* column 4c + j of block b: digit c of row 4b + j */
        int r = ROWS_PER_TILE * (v / 16) + v % ROWS_PER_TILE;
        float digit = 1.0f;
        for (int c = 0; c < v % 16 / ROWS_PER_TILE; c++) digit /= BASE;
        col_s[v] = r < rows ? row_s[r] * digit : 0.0f;
    }
    memset(acc, 0, sizeof(float) * 1024 * (size_t)blocks);
    unpack_rows(packed, zero, abuf, o, 16 * M, in, group);
    for (int g = 0; g < groups; g++) {
        int b = 0;
        for (; b + 2 <= blocks; b += 2) {
            if (M == 2) group_tiles(abuf, xd, scale, col_s, acc, o, g, b, 2, 2, in, group);
            else group_tiles(abuf, xd, scale, col_s, acc, o, g, b, 1, 2, in, group);
        }
        if (b < blocks) {
            if (M == 2) group_tiles(abuf, xd, scale, col_s, acc, o, g, b, 2, 1, in, group);
            else group_tiles(abuf, xd, scale, col_s, acc, o, g, b, 1, 1, in, group);
        }
        if (g % 16 == 15 || g == groups - 1)
            for (int64_t i = 0; i < 512 * (int64_t)blocks; i += 16) {
                _mm512_store_ps(total + i, _mm512_add_ps(_mm512_load_ps(total + i), _mm512_load_ps(acc + i)));
                _mm512_store_ps(acc + i, _mm512_setzero_ps());
            }
    }
    for (int b = 0; b < blocks; b++)
        for (int h = 0; h < M; h++) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(total + 512 * b + 256 * h + 16 * i);
            int first = ROWS_PER_TILE * b, n = rows - first < ROWS_PER_TILE ? rows - first : ROWS_PER_TILE;
            transpose16(r);  /* r[v]: column v, each already times its row's s / 254^c: the digits add */
            for (int j = 0; j < n; j++)
                _mm512_storeu_ps(y + (int64_t)(first + j) * out + o + 16 * h,
                                 _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(r[12 + j], r[8 + j]), r[4 + j]), r[j]));
        }
}

/* -- both --------------------------------------------------------------------------------------------------------- */

/* n rows of x into y (n <= CHUNK_ROWS, which the buffers are sized for). Returns 1 when a thread's int4 buffers
 * cannot be allocated. */
static int chunk(const float *x, const matrix *m, float *y, int n, int threads, int8_t *digits, int8_t *xd,
                 float *row_s) {
    int in = m->in, out = m->out, blocks = (n + ROWS_PER_TILE - 1) / ROWS_PER_TILE, units = (out + 31) / 32;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < n; r++) digits_of(x, digits, row_s, r, in);
        #pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++) pack_quads(digits, xd, n, in, b);
        float *acc = m->zero ? (float *)aligned_alloc(64, sizeof(float) * 1024 * (size_t)blocks) : NULL;
        int8_t *abuf = m->zero ? (int8_t *)aligned_alloc(64, (size_t)32 * m->in) : NULL;
        failed = m->zero && (!acc || !abuf);
        tile_config saved;
        amx_configure(&saved);
        #pragma omp for schedule(static)
        for (int u = 0; u < units; u++) {
            int o = 32 * u, M = out - o >= 32 ? 2 : 1;
            if (!m->zero) int8_output_block((const int8_t *)m->codes, xd, m->scale, row_s, y, o, M, n, out, in);
            else if (!failed)
                int4_unit((const uint8_t *)m->codes, m->scale, m->zero, xd, row_s, y, acc, abuf, o, M, n, out, in,
                          m->group);
        }
        amx_restore(&saved);
        free(acc), free(abuf);
    }
    for (int r = 0; r < n && !failed; r++)
        if (row_s[r] < 0.0f) scalar_row(x, m, y, r, threads);
    return failed;
}

/* Both formats, CHUNK_ROWS rows of x at a time (a long prompt's digits would otherwise take 8 bytes a value). */
static int product(const float *x, const matrix *m, float *y, int rows, int threads) {
    if (m->in % 64 || m->in > MAX_IN || m->out % 16 || rows < 1 || (m->zero && (m->group % 64 || m->in % m->group))
        || !amx_granted())
        return 2;
    if (rows == 1 && m->zero)  /* on the vector units (quantized_vnni.c) */
        return int4_vnni_matvec(x, (const uint8_t *)m->codes, m->scale, m->zero, y, m->out, m->in, m->group, threads);
    int most = rows < CHUNK_ROWS ? rows : CHUNK_ROWS, blocks = (most + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
    int8_t *digits = (int8_t *)malloc((size_t)most * DIGITS * m->in);
    int8_t *xd = (int8_t *)aligned_alloc(64, (size_t)blocks * 16 * m->in);
    float *row_s = (float *)malloc((size_t)most * sizeof(float));
    int status = !digits || !xd || !row_s;
    for (int r = 0; !status && r < rows; r += most) {
        int n = rows - r < most ? rows - r : most;
        status = chunk(x + (int64_t)r * m->in, m, y + (int64_t)r * m->out, n, threads, digits, xd, row_s);
    }
    free(digits), free(xd), free(row_s);
    return status;
}
#endif

/* 1 where int8_amx_matmul and int4_amx_matmul run: built for AMX-INT8 and the tile registers granted to this
 * process. Asks once. */
int quantized_amx_ready(void) {
#if defined(QUANTIZED_AMX)
    return amx_granted();
#else
    return 0;
#endif
}

/* y = x @ ŵᵀ on the tile registers, int8 codes. Returns 0; 1 when x's digits cannot be allocated; 2 for shapes
 * it does not take (in % 64, out % 16) or where it is not built or granted (quantized_amx_ready() == 0). The
 * caller's tile configuration is put back after. */
int int8_amx_matmul(const float *x, const int8_t *q, const float *scale, float *y, int rows, int out, int in,
                    int threads) {
#if defined(QUANTIZED_AMX)
    matrix m = {q, scale, NULL, out, in, 0};
    return product(x, &m, y, rows, threads);
#else
    (void)x, (void)q, (void)scale, (void)y, (void)rows, (void)out, (void)in, (void)threads;
    return 2;
#endif
}

/* The same for int4 codes, group a multiple of 64 dividing in (else 2). */
int int4_amx_matmul(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero, float *y,
                    int rows, int out, int in, int group, int threads) {
#if defined(QUANTIZED_AMX)
    matrix m = {packed, scale, zero, out, in, group};
    return product(x, &m, y, rows, threads);
#else
    (void)x, (void)packed, (void)scale, (void)zero, (void)y, (void)rows, (void)out, (void)in, (void)group,
        (void)threads;
    return 2;
#endif
}
