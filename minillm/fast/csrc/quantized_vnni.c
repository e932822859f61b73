/* int8 and int4 products at one row of x (a decode step's) on the vector units, x kept at float32's precision as
 * four int8 digits (quantized_digits.h: the formats, the digits, their error bound). AVX512-VNNI's vpdpbusd
 * multiplies 64 unsigned bytes by 64 signed ones into 16 int32 sums, exactly: the codes are the unsigned operand,
 * x's digits the signed one, and nothing is unpacked into memory. Where it runs:
 *
 *   int4, one row, a CPU with AMX   quantized_amx.c calls it: the tiles first copy the codes out of their nibbles
 *   int8 and int4, one row, a CPU   quantized.c's int8_matvec and int4_matvec call it (AMD from Zen 4, Intel Xeon
 *     with AVX512-VNNI              from Cascade Lake): widening each code to float32 there took 1.6-1.9x (int8) and
 *                                   1.5-3.1x (int4) its time (BENCHMARKS.md, "Quantised decode on the vector units")
 *
 * minillm.fast.products keeps int8's one row on the tiles where there are some (this loop took 1.1x their time);
 * quantized_matvec runs it here on any CPU with AVX512-VNNI. Needs in a
 * multiple of 64 up to 131072 and out a multiple of 4 (int4: of 2, and group a multiple of 64 dividing in).
 */
#include "quantized_digits.h"

#if defined(QUANTIZED_DIGITS)

#define INT8_ROWS 4  /* rows of codes at a time, sharing x's digits (two: 12 % slower at SmolLM2-1.7B's matrices) */
#define INT4_ROWS 2  /* (its sums take twice the registers) */
#define FLUSH_BLOCKS 4  /* int4: the most blocks of 128 ks a flush's sums span */

/* -- int8 --------------------------------------------------------------------------------------------------------- */

/* vpdpbusd's unsigned operand is the codes with their top bit flipped, q + 128, so lane l of a sum over the row is
 *
 *   Σ (q[k] + 128) · d_c[k]  =  Σ q[k] · d_c[k]  +  128 · S_c[l]     (S_c[l]: the lane's sum of digit c: x's alone)
 *
 * 128 · S_c is taken out lane by lane in int32, which leaves D_c, the tiles' exact int32 sum (|D_c| <= in · 127²
 * < 2^31); it is combined as quantized_amx.c's store_tile combines it, so one row gives the tiles' values bit for
 * bit. */

/* bias[c]: 128 · S_c, lane by lane, for digits [DIGITS][in] */
static void int8_bias(const int8_t *digits, int in, __m512i bias[DIGITS]) {
    __m512i ones = _mm512_set1_epi8(1);
    for (int c = 0; c < DIGITS; c++) {
        __m512i s = _mm512_setzero_si512();
        for (int k = 0; k < in; k += 64) s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(digits + c * in + k));
        bias[c] = _mm512_slli_epi32(s, 7);
    }
}

/* One row of codes (64 of them, w, their top bits flipped) by x's four digits d0..d3 into its sums t##0..t##3. */
#define INT8_DOT(t, w) \
    t##0 = _mm512_dpbusd_epi32(t##0, w, d0); t##1 = _mm512_dpbusd_epi32(t##1, w, d1); \
    t##2 = _mm512_dpbusd_epi32(t##2, w, d2); t##3 = _mm512_dpbusd_epi32(t##3, w, d3)

/* y[o .. o + INT8_ROWS - 1], four named rows (r0..r3, their sums a..e). */
#if INT8_ROWS != 4
#error "int8_rows names its four rows of codes one by one"
#endif
static void int8_rows(const matrix *m, const int8_t *digits, const __m512i bias[DIGITS], float row_s, float *y,
                      int o) {
    int in = m->in;
    /* rows ahead (common.h), into L2 (into L1 the products took 1.4x the time); past the matrix's end 0, a row's own
     * line (a branch in the loop made gcc copy every sum between registers at each step, 10 % slower) */
    int rows = rows_ahead(in, INT8_ROWS);
    int64_t ahead = o + INT8_ROWS + rows <= m->out ? (int64_t)rows * in : 0;
    const int8_t *r0 = (const int8_t *)m->codes + (int64_t)o * in, *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in;
    __m512i flip = _mm512_set1_epi8((char)0x80), z = _mm512_setzero_si512();
    __m512i a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    __m512i c0 = z, c1 = z, c2 = z, c3 = z, e0 = z, e1 = z, e2 = z, e3 = z;
    for (int k = 0; k < in; k += 64) {
        __m512i d0 = _mm512_loadu_si512(digits + k), d1 = _mm512_loadu_si512(digits + in + k);
        __m512i d2 = _mm512_loadu_si512(digits + 2 * in + k), d3 = _mm512_loadu_si512(digits + 3 * in + k);
        _mm_prefetch((const char *)r0 + ahead + k, _MM_HINT_T1);
        _mm_prefetch((const char *)r1 + ahead + k, _MM_HINT_T1);
        _mm_prefetch((const char *)r2 + ahead + k, _MM_HINT_T1);
        _mm_prefetch((const char *)r3 + ahead + k, _MM_HINT_T1);
        __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(r0 + k), flip);
        __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(r1 + k), flip);
        __m512i w2 = _mm512_xor_si512(_mm512_loadu_si512(r2 + k), flip);
        __m512i w3 = _mm512_xor_si512(_mm512_loadu_si512(r3 + k), flip);
        INT8_DOT(a, w0);
        INT8_DOT(b, w1);
        INT8_DOT(c, w2);
        INT8_DOT(e, w3);
    }
    __m512i t[INT8_ROWS][DIGITS] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {c0, c1, c2, c3}, {e0, e1, e2, e3}};
    for (int i = 0; i < INT8_ROWS; i++) {
        float d[DIGITS], inv = 1.0f / BASE;
        for (int c = 0; c < DIGITS; c++) d[c] = (float)_mm512_reduce_add_epi32(_mm512_sub_epi32(t[i][c], bias[c]));
        float sum = fmaf(fmaf(fmaf(d[3], inv, d[2]), inv, d[1]), inv, d[0]);
        y[o + i] = sum * row_s * m->scale[o + i];  /* (row_s first: exact; scale · row_s can overflow) */
    }
}

/* y [1, out] = x [1, in] @ ŵᵀ for int8 codes. Returns 1 when x's digits cannot be allocated. */
static int int8_one_row(const float *x, const matrix *m, float *y, int threads) {
    int8_t *digits = (int8_t *)malloc((size_t)DIGITS * m->in);
    if (!digits) return 1;
    float row_s = 0.0f;
    __m512i bias[DIGITS];
    digits_of(x, digits, &row_s, 0, m->in);
    int8_bias(digits, m->in, bias);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < m->out; o += INT8_ROWS) int8_rows(m, digits, bias, row_s, y, o);
    if (row_s < 0.0f) scalar_row(x, m, y, 0, threads);
    free(digits);
    return 0;
}

/* -- int4 --------------------------------------------------------------------------------------------------------- */

/* A decode step multiplies one row of x. On the tiles each int4 code is first unpacked into memory (int4_unit), and
 * at one row SmolLM2-1.7B's matrices streamed 10 GB/s. Here each 64 bytes of a row's codes are split into their
 * two nibble planes in registers and multiplied by x's digits with AVX512-VNNI's vpdpbusd (64 unsigned bytes by 64
 * signed ones into 16 int32 sums, exact). Byte j of the row's block b (64 bytes, 128 ks) holds q[128b + 2j] in its
 * low nibble and q[128b + 2j + 1] in its high one, so with x's digits laid out to match,
 *
 *   xe_c[b][j] = d_c[128b + 2j],  xo_c[b][j] = d_c[128b + 2j + 1]
 *   lane l of  dpbusd(low nibbles, xe_c) + dpbusd(high nibbles, xo_c)  =  Σ q[k] · d_c[k] over k = 128b + 8l .. + 7
 *
 * A lane's ks lie in one group (group a multiple of 64); a block's lanes in at most two. The sums T_c of a block,
 * or of the blocks of one group (group a multiple of 128, at most FLUSH_BLOCKS blocks), are scaled then ("a
 * flush"), lane by lane:
 *
 *   Σ_c (T_c - zero · S_c) / 254^c · scale     (S_c: the lane's sum of digit c; the zero point out of the sums)
 *
 * in pairs of digits, each pair's integers combined in int32 first (T_01 = 254 · T_0 + T_1, S_01 likewise):
 *
 *   ((T_01 - zero · S_01) + (T_23 - zero · S_23) / 254²) · s / 254 · scale
 *
 * half the float work four digits took, and the flushes are most of the loop's time (a group of 64 is a flush a
 * block; groups of 2048 took 0.67x its time): one row, 2 threads, AMD EPYC, 2048 x 2048 133.6 -> 126.4 us, 8192 x
 * 2048 465 -> 437, 2048 x 8192 476 -> 435, 3072 x 576 78.8 -> 75.4 (three alternating runs each). Each zero term
 * is subtracted exactly, lane by lane: a flush holds at most 32 ks a lane, so T_01 and zero · S_01 are integers of
 * at most 32 · 15 · 127 · 255 < 2^24, which float32 holds, and one fnmadd rounds their difference once, to itself
 * (test_int4_pair_sums_at_a_flushs_largest_are_exact). Taken once a row in float32
 * instead, their rounding gave up to 9x the error tests/fast/test_quantized_amx.py allows where x's values (or
 * their lower digits) share a sign: the terms are then as large as the sums. Two rows of codes at a time share x's
 * digits; the next two rows are prefetched (without it the rows streamed at 11 GB/s, with it 19); each row's zeros
 * and scales are read 16 groups at a time. The sums of four flushes at a time are added into float64 ones: a
 * float32 running sum's roundings grow with in, the bound does not (a new user's trial: rows whose sums all round
 * up, 104x over it at in = 131,072; same-sign rows 1.5x). */

typedef struct {  /* x's row, laid out for the vector units */
    int8_t *xe, *xo;  /* [blocks][DIGITS][64] */
    float *sums;      /* [flushes][2][16]: S_01 and S_23, lane by lane (integers) */
    int32_t *lane_group;  /* [flushes][16]: each lane's group, less the flush's first */
    int *group0;      /* [flushes]: the first group a flush's lanes hold */
} row_digits;

/* 1 where the sums are scaled after block b: unless b and the next block lie in one group, and at least every
 * FLUSH_BLOCKS blocks, which keeps a digit pair's sums exact in float32 (int4_rows says how). */
static inline int flush_after(int b, int blocks, int group) {
    return b == blocks - 1 || 128 * b / group != (128 * b + 255) / group || b % FLUSH_BLOCKS == FLUSH_BLOCKS - 1;
}

/* digits [DIGITS][in] (digits_of's) -> r: each 128 ks' even and odd digits apart (the low bytes of 16-bit lanes, then
 * the high ones), and their sums a lane (a dpbusd of ones). */
static void lay_out_digits(const int8_t *digits, row_digits *r, int in, int group) {
    int blocks = (in + 127) / 128, f = 0, start = 0;  /* start: the flush's first block */
    __m512i ones = _mm512_set1_epi8(1), none = _mm512_setzero_si512();
    __m512 sums[DIGITS], base = _mm512_set1_ps(BASE);
    for (int c = 0; c < DIGITS; c++) sums[c] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        for (int c = 0; c < DIGITS; c++) {
            const int8_t *d = digits + (int64_t)c * in + 128 * b;
            __m512i w0 = _mm512_loadu_si512(d), w1 = 128 * b + 128 <= in ? _mm512_loadu_si512(d + 64) : none;
            __m512i even = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(w0)),
                                              _mm512_cvtepi16_epi8(w1), 1);
            __m512i odd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(w0, 8))),
                                             _mm512_cvtepi16_epi8(_mm512_srai_epi16(w1, 8)), 1);
            _mm512_store_si512(r->xe + (b * DIGITS + c) * 64, even);
            _mm512_store_si512(r->xo + (b * DIGITS + c) * 64, odd);
            sums[c] = _mm512_add_ps(sums[c], _mm512_cvtepi32_ps(
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(none, ones, even), ones, odd)));
        }
        if (flush_after(b, blocks, group)) {
            r->group0[f] = 128 * start / group;
            for (int c = 0; c < DIGITS; c += 2) {  /* (exact: integers under 2^24) */
                _mm512_store_ps(r->sums + (f * 2 + c / 2) * 16, _mm512_fmadd_ps(sums[c], base, sums[c + 1]));
                sums[c] = sums[c + 1] = _mm512_setzero_ps();
            }
            for (int l = 0; l < 16; l++) r->lane_group[16 * f + l] = (128 * b + 8 * l) / group - r->group0[f];
            f++, start = b + 1;
        }
    }
}

/* y[o], y[o + 1]. */
static void int4_rows(const matrix *m, const row_digits *r, float row_s, float *y, int o) {
    int in = m->in, groups = in / m->group, blocks = (in + 127) / 128, half = in / 2;
    const uint8_t *codes = (const uint8_t *)m->codes;
    __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[INT4_ROWS];  /* the last (up to) four flushes' sums, then added into wide in float64 */
    double wide[INT4_ROWS][16] __attribute__((aligned(64))) = {{0}};  /* in memory: the hot loop keeps its registers */
    __m512i t[INT4_ROWS][DIGITS];
    for (int i = 0; i < INT4_ROWS; i++) {
        acc[i] = _mm512_setzero_ps();
        for (int c = 0; c < DIGITS; c++) t[i][c] = _mm512_setzero_si512();
    }
    __m512 zeros[INT4_ROWS], scales[INT4_ROWS];  /* groups window .. window + 15 */
    for (int i = 0; i < INT4_ROWS; i++) zeros[i] = scales[i] = _mm512_setzero_ps();  /* (read only once loaded) */
    /* Each flush's sums are times s / 254 (x's scale, a power of two from 2^-107) before the groups' scales, where a
     * sum (up to 2^24) times its scale, or a scale times s, can leave float32's range and the result not (trials:
     * scale 2e37 with x 1e-20, inf; 1e38 with s = 2^14 and a group of zeros, NaN; 2^-124 with s = 2^-32, 0) */
    __m512 x_scale = _mm512_set1_ps(row_s / BASE), inv_square = _mm512_set1_ps(1.0f / (BASE * BASE));
    __m512i base = _mm512_set1_epi32((int)BASE);
    int prefetch = o + 2 * INT4_ROWS <= m->out, window = -16;
    for (int b = 0, f = 0; b < blocks; b++) {
        __mmask64 live = 128 * b + 128 <= in ? ~(__mmask64)0 : ((__mmask64)1 << 32) - 1;  /* a last 64 ks: 32 bytes */
        for (int i = 0; i < INT4_ROWS; i++) {
            const uint8_t *row = codes + (int64_t)(o + i) * half + 64 * b;
            if (prefetch) _mm_prefetch((const char *)row + (int64_t)INT4_ROWS * half, _MM_HINT_T0);
            __m512i w = _mm512_maskz_loadu_epi8(live, row);
            __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            for (int c = 0; c < DIGITS; c++) {
                t[i][c] = _mm512_dpbusd_epi32(t[i][c], lo, _mm512_load_si512(r->xe + (b * DIGITS + c) * 64));
                t[i][c] = _mm512_dpbusd_epi32(t[i][c], hi, _mm512_load_si512(r->xo + (b * DIGITS + c) * 64));
            }
        }
        if (!flush_after(b, blocks, m->group)) continue;
        const float *sums = r->sums + f * 2 * 16;
        int g0 = r->group0[f];
        if (g0 + 1 >= window + 16) {  /* the next 16 groups' zeros and scales, a row at a time */
            window = g0;
            __mmask16 k = groups - g0 >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g0)) - 1);
            for (int i = 0; i < INT4_ROWS; i++) {
                int64_t at = (int64_t)(o + i) * groups + g0;
                zeros[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, m->zero + at)));
                scales[i] = _mm512_maskz_loadu_ps(k, m->scale + at);
            }
        }
        __m512i lanes = _mm512_add_epi32(_mm512_load_si512(r->lane_group + 16 * f++), _mm512_set1_epi32(g0 - window));
        for (int i = 0; i < INT4_ROWS; i++) {
            __m512 zero = _mm512_permutexvar_ps(lanes, zeros[i]), pair[2];
            for (int c = 0; c < DIGITS; c += 2) {
                __m512i t_pair = _mm512_add_epi32(_mm512_mullo_epi32(t[i][c], base), t[i][c + 1]);
                pair[c / 2] = _mm512_fnmadd_ps(zero, _mm512_load_ps(sums + 8 * c), _mm512_cvtepi32_ps(t_pair));
            }
            __m512 sum = _mm512_fmadd_ps(pair[1], inv_square, pair[0]);  /* 254 times the lanes' value */
            __m512 scale = _mm512_permutexvar_ps(lanes, scales[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(sum, x_scale), scale, acc[i]);
            for (int c = 0; c < DIGITS; c++) t[i][c] = _mm512_setzero_si512();
        }
        if (f % 4 == 0 || b == blocks - 1)
            for (int i = 0; i < INT4_ROWS; i++) {
                _mm512_store_pd(wide[i], _mm512_add_pd(_mm512_load_pd(wide[i]),
                                                       _mm512_cvtps_pd(_mm512_castps512_ps256(acc[i]))));
                _mm512_store_pd(wide[i] + 8, _mm512_add_pd(_mm512_load_pd(wide[i] + 8),
                                                           _mm512_cvtps_pd(_mm512_extractf32x8_ps(acc[i], 1))));
                acc[i] = _mm512_setzero_ps();
            }
    }
    for (int i = 0; i < INT4_ROWS; i++)
        y[o + i] = (float)_mm512_reduce_add_pd(_mm512_add_pd(_mm512_load_pd(wide[i]), _mm512_load_pd(wide[i] + 8)));
}

/* y [1, out] = x [1, in] @ ŵᵀ for int4 codes (out even, in and group multiples of 64). Returns 1 when x's digits
 * cannot be allocated. */
static int int4_one_row(const float *x, const matrix *m, float *y, int threads) {
    int in = m->in, blocks = (in + 127) / 128;
    size_t plane = (size_t)blocks * DIGITS * 64;
    int8_t *digits = (int8_t *)malloc((size_t)DIGITS * in);
    row_digits r = {(int8_t *)aligned_alloc(64, plane), (int8_t *)aligned_alloc(64, plane),
                    (float *)aligned_alloc(64, sizeof(float) * DIGITS * 16 * blocks),
                    (int32_t *)aligned_alloc(64, sizeof(int32_t) * 16 * blocks), (int *)malloc(sizeof(int) * blocks)};
    int failed = !digits || !r.xe || !r.xo || !r.sums || !r.lane_group || !r.group0;
    float row_s = 0.0f;
    if (!failed) {
        digits_of(x, digits, &row_s, 0, in);
        lay_out_digits(digits, &r, in, m->group);
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int o = 0; o < m->out; o += INT4_ROWS) int4_rows(m, &r, row_s, y, o);
        if (row_s < 0.0f) scalar_row(x, m, y, 0, threads);
    }
    free(digits), free(r.xe), free(r.xo), free(r.sums), free(r.lane_group), free(r.group0);
    return failed;
}

#endif

/* 1 where int8_vnni_matvec and int4_vnni_matvec run: the build targets AVX512-VNNI. */
int quantized_vnni_ready(void) {
#if defined(QUANTIZED_DIGITS)
    return 1;
#else
    return 0;
#endif
}

/* y [1, out] = x [1, in] @ ŵᵀ, int8 codes. Returns 0; 1 when x's digits cannot be allocated; 2 for shapes it does
 * not take (in % 64, out % 4) or where it is not built (quantized_vnni_ready() == 0). */
int int8_vnni_matvec(const float *x, const int8_t *q, const float *scale, float *y, int out, int in, int threads) {
#if defined(QUANTIZED_DIGITS)
    if (in < 64 || in % 64 || in > MAX_IN || out < 1 || out % INT8_ROWS) return 2;
    matrix m = {q, scale, NULL, out, in, 0};
    return int8_one_row(x, &m, y, threads);
#else
    (void)x, (void)q, (void)scale, (void)y, (void)out, (void)in, (void)threads;
    return 2;
#endif
}

/* The same for int4 codes, group a multiple of 64 dividing in (else 2). */
int int4_vnni_matvec(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero, float *y, int out,
                     int in, int group, int threads) {
#if defined(QUANTIZED_DIGITS)
    if (in < 64 || in % 64 || in > MAX_IN || out < 1 || out % INT4_ROWS || group < 64 || group % 64 || in % group)
        return 2;
    matrix m = {packed, scale, zero, out, in, group};
    return int4_one_row(x, &m, y, threads);
#else
    (void)x, (void)packed, (void)scale, (void)zero, (void)y, (void)out, (void)in, (void)group, (void)threads;
    return 2;
#endif
}
