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
 * at one row SmolLM2-1.7B's matrices streamed 10 GB/s. Here each 64 bytes of a row's codes (a block: 128 ks) are
 * split into their two nibble planes in registers and multiplied by x's digits with vpdpbusd. Byte j of block b
 * holds q[128b + 2j] in its low nibble and q[128b + 2j + 1] in its high one, so with x's digits laid out to match
 * (xe_c: digit c of the even ks, xo_c: of the odd ones), lane l of
 *
 *   dpbusd(low nibbles, xe_c) + dpbusd(high nibbles, xo_c)  =  Σ q[k] · d_c[k] over the 8 ks of the lane's 4 bytes
 *
 * Each group has its own zero point and scale, so a lane's sums T_c are scaled ("a flush") before they meet another
 * group's ks; a group holds whole units of 64 ks, and a block's 16 lanes hold two units, 8 lanes each. Four blocks
 * (a span) are therefore shuffled as they are loaded (gather_units: a 4 x 4 transpose of 32-bit lanes, eight
 * unpacks) into four registers in which every lane holds one unit's ks: its sums run over the four blocks, and a
 * flush comes every 512 ks instead of every 128 (x's digits are shuffled alike, once a product). A row's last one to
 * three blocks make spans of two (four unpacks) and one (none). A flush scales the sums lane by lane:
 *
 *   Σ_c (T_c - zero · S_c) / 254^c · scale     (S_c: the lane's sum of digit c: x's alone)
 *
 * in pairs of digits (T_01 = 254 · T_0 + T_1, S_01 likewise):
 *
 *   ((T_01 - zero · S_01) + (T_23 - zero · S_23) / 254²) · s / 254 · scale
 *
 * Each zero term is subtracted exactly, lane by lane: a span holds at most 32 ks a lane, so T_01 and zero · S_01
 * are integers of at most 32 · 15 · 127 · 255 < 2^24, which float32 holds (T_0 · 254 + T_1 too: one fmadd), and
 * one fnmadd rounds their difference once, to itself (test_int4_pair_sums_at_a_flushs_largest_are_exact). Taken
 * once a row in float32 instead, their rounding gave up to 9x the error tests/fast/test_quantized_amx.py allows
 * where x's values (or their lower digits) share a sign: the terms are then as large as the sums. Two rows of codes
 * at a time share x's digits (in registers: 64 vpdpbusd a span, 32 loads of digits); rows ahead are fetched into L2
 * as int8's are.
 *
 * What rounds, lane by lane: a flush's pair sum (one fmadd), then the two flushes at a time added times their scales
 * (one fmadd each) before a float64 sum takes them, and the result's conversion to float32: four roundings, inside
 * tests/fast/digits_bound.py's five. x's scale goes in as s / 256, a power of two (exact), and 256 / 254 times the
 * float64 sum at the end. Four flushes a float32 sum, and s / 254 (itself rounded) times each flush, made eight, and
 * a new user's trial met 1.14x the bound: a lane's sum just above a power of two, every later flush 0.51 of its ulp
 * (test_int4_roundings_that_all_go_one_way_keep_the_bound). A float32 running sum's roundings grow with in, the
 * bound does not (another trial: rows whose sums all round up, 104x over it at in = 131,072).
 *
 * A flush every block, and two rows' sums in arrays the compiler kept in memory (a loop over the rows it did not
 * unroll), took 1.4x this loop's time: the 1.7B shape's int4 products at one row, 2 threads, AMD EPYC Zen 4, 11.7 ->
 * 8.1 ms (benchmarks/decode_products.py). It is compute-bound (~29 GB/s there; int8's loop streams ~50): eight
 * vpdpbusd a block of a row, for x's four digits, where llama.cpp's Q4_0 rounds x to one. */

#define SPAN 4  /* blocks a flush takes (and a row's last spans 2 and 1) */

typedef struct {  /* x's row, laid out for the vector units */
    int8_t *xe, *xo;      /* [blocks][DIGITS][64]: each span's blocks in gather_units' order */
    float *sums;          /* [spans][2][16]: S_01 and S_23, lane by lane (integers) */
    int32_t *lane_group;  /* [spans][16]: each lane's group, less the span's first */
    int *group0;          /* [spans]: the span's first group */
    int groups, rows_ahead;  /* a row's groups; the rows fetched ahead of two (common.h, as int8_rows') */
} row_digits;

/* The blocks of the span that starts at block b of a row of `blocks` (a half block counted whole). */
static inline int span_at(int b, int blocks) {
    int left = blocks - b;
    return left >= SPAN ? SPAN : left >= 2 ? 2 : 1;
}

/* n blocks v[0..n-1] -> n registers in which every lane holds one unit's dwords. Lane 4k + p of block b (128-bit
 * lane k, position p) holds dword 4 (k % 2) + p of unit 2b + k / 2. Four blocks: a transpose of the 4 x 4 dwords
 * at each 128-bit lane k puts block p's at position p, so lane 4k + p of register j holds dword 4 (k % 2) + j of
 * unit 2p + k / 2. Two blocks: positions p and p + 2 hold block p % 2's dwords, one in each register. */
static inline void gather_units(__m512i v[], int n) {
    if (n == 1) return;
    __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    if (n == 2) {
        v[0] = t0, v[1] = t1;
        return;
    }
    __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The 64 bytes of block b of a row p of `in` ks' codes (in / 2 bytes): a last half block's 32 and zeros. */
static inline __m512i load_block(const uint8_t *p, int b, int in) {
    if (128 * b + 128 <= in) return _mm512_loadu_si512(p + 64 * b);
    return _mm512_maskz_loadu_epi8(((__mmask64)1 << 32) - 1, p + 64 * b);
}

/* digits [DIGITS][in] (digits_of's) -> r: each 128 ks' even and odd digits apart (the low bytes of 16-bit lanes, then
 * the high ones), each span's in gather_units' order, their sums a lane (a dpbusd of ones), and each lane's group
 * (the units' numbers shuffled alike). */
static void lay_out_digits(const int8_t *digits, row_digits *r, int in, int group) {
    int blocks = (in + 127) / 128;
    __m512i ones = _mm512_set1_epi8(1), none = _mm512_setzero_si512();
    __m512 base = _mm512_set1_ps(BASE);
    for (int b = 0, f = 0, n; b < blocks; b += n, f++) {
        n = span_at(b, blocks);
        __m512 sums[DIGITS];
        for (int c = 0; c < DIGITS; c++) {
            __m512i even[SPAN], odd[SPAN], s = none;
            for (int j = 0; j < n; j++) {
                const int8_t *d = digits + (int64_t)c * in + 128 * (b + j);
                __m512i w0 = _mm512_loadu_si512(d), w1 = 128 * (b + j) + 128 <= in ? _mm512_loadu_si512(d + 64) : none;
                even[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(w0)),
                                             _mm512_cvtepi16_epi8(w1), 1);
                odd[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(w0, 8))),
                                            _mm512_cvtepi16_epi8(_mm512_srai_epi16(w1, 8)), 1);
            }
            gather_units(even, n), gather_units(odd, n);
            for (int j = 0; j < n; j++) {
                _mm512_store_si512(r->xe + ((b + j) * DIGITS + c) * 64, even[j]);
                _mm512_store_si512(r->xo + ((b + j) * DIGITS + c) * 64, odd[j]);
                s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s, ones, even[j]), ones, odd[j]);
            }
            sums[c] = _mm512_cvtepi32_ps(s);
        }
        for (int c = 0; c < DIGITS; c += 2)  /* (exact: integers under 2^24) */
            _mm512_store_ps(r->sums + (f * 2 + c / 2) * 16, _mm512_fmadd_ps(sums[c], base, sums[c + 1]));
        __m512i units[SPAN];  /* lane i of block b + j: unit 2 (b + j) + i / 8 */
        for (int j = 0; j < n; j++)
            units[j] = _mm512_add_epi32(_mm512_set1_epi32(2 * (b + j)),
                                        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
        gather_units(units, n);
        int32_t lane_unit[16];
        _mm512_storeu_si512(lane_unit, units[0]);
        r->group0[f] = 128 * b / group;
        for (int l = 0; l < 16; l++) r->lane_group[16 * f + l] = 64 * lane_unit[l] / group - r->group0[f];
    }
}

typedef struct {  /* two rows' flushes */
    __m512 zeros0, zeros1, scales0, scales1;  /* their groups window .. window + 15 */
    __m512 acc0, acc1;  /* the last (up to) two flushes' sums, then added into wide in float64 */
    double (*wide)[16];  /* the two rows' float64 sums (in memory: the hot loop keeps its registers) */
    int window, flushes;
} row_sums;

/* One flush of a row's sums t0..t3: their value times 254 / s, lane by lane, before the groups' scales (rounded
 * once: the pairs' differences are exact integers). */
static inline __m512 flushed(__m512i t0, __m512i t1, __m512i t2, __m512i t3, __m512 zero, const float *sums) {
    __m512 base = _mm512_set1_ps(BASE);
    __m512 pair0 = _mm512_fnmadd_ps(zero, _mm512_load_ps(sums),
                                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(t0), base, _mm512_cvtepi32_ps(t1)));
    __m512 pair1 = _mm512_fnmadd_ps(zero, _mm512_load_ps(sums + 16),
                                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(t2), base, _mm512_cvtepi32_ps(t3)));
    return _mm512_fmadd_ps(pair1, _mm512_set1_ps(1.0f / (BASE * BASE)), pair0);
}

/* float64 sums += a float32 vector's lanes */
static inline void add_wide(double *wide, __m512 v) {
    _mm512_store_pd(wide, _mm512_add_pd(_mm512_load_pd(wide), _mm512_cvtps_pd(_mm512_castps512_ps256(v))));
    _mm512_store_pd(wide + 8, _mm512_add_pd(_mm512_load_pd(wide + 8), _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1))));
}

/* Span f's sums of rows o and o + 1 (a0..a3, b0..b3) into t. Each flush's sums are times s / 256 (s: x's scale, a
 * power of two from 2^-107) before the groups' scales, where a sum (up to 2^24) times its scale, or a scale times s,
 * can leave float32's range and the result not (trials: scale 2e37 with x 1e-20, inf; 1e38 with s = 2^14 and a group
 * of zeros, NaN; 2^-124 with s = 2^-32, 0). */
static inline void flush(const matrix *m, const row_digits *r, row_sums *t, int o, int f, float row_s,
                         __m512i a0, __m512i a1, __m512i a2, __m512i a3,
                         __m512i b0, __m512i b1, __m512i b2, __m512i b3) {
    int groups = r->groups, g0 = r->group0[f];
    if (g0 + 7 >= t->window + 16) {  /* the next 16 groups' zeros and scales (a span's lanes span at most 8) */
        t->window = g0;
        __mmask16 k = groups - g0 >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g0)) - 1);
        int64_t at = (int64_t)o * groups + g0;
        t->zeros0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, m->zero + at)));
        t->zeros1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, m->zero + at + groups)));
        t->scales0 = _mm512_maskz_loadu_ps(k, m->scale + at);
        t->scales1 = _mm512_maskz_loadu_ps(k, m->scale + at + groups);
    }
    __m512i lanes = _mm512_add_epi32(_mm512_load_si512(r->lane_group + 16 * f), _mm512_set1_epi32(g0 - t->window));
    const float *sums = r->sums + f * 2 * 16;
    __m512 x_scale = _mm512_set1_ps(row_s / 256);
    __m512 s0 = flushed(a0, a1, a2, a3, _mm512_permutexvar_ps(lanes, t->zeros0), sums);
    __m512 s1 = flushed(b0, b1, b2, b3, _mm512_permutexvar_ps(lanes, t->zeros1), sums);
    t->acc0 = _mm512_fmadd_ps(_mm512_mul_ps(s0, x_scale), _mm512_permutexvar_ps(lanes, t->scales0), t->acc0);
    t->acc1 = _mm512_fmadd_ps(_mm512_mul_ps(s1, x_scale), _mm512_permutexvar_ps(lanes, t->scales1), t->acc1);
    if (++t->flushes % 2 == 0) {
        add_wide(t->wide[0], t->acc0), add_wide(t->wide[1], t->acc1);
        t->acc0 = t->acc1 = _mm512_setzero_ps();
    }
}

/* One register of each row's shuffled codes (v, w) by x's digits there (xe, xo: DIGITS registers each): low nibbles
 * by the even ks' digits, high ones by the odd ks', into the rows' sums a0..a3 and b0..b3. */
#define INT4_DOT(v, w, xe, xo) do {                                                                        \
        __m512i lo_v = _mm512_and_si512(v, low), hi_v = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);      \
        __m512i lo_w = _mm512_and_si512(w, low), hi_w = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);      \
        __m512i de = _mm512_load_si512(xe), d_o = _mm512_load_si512(xo);                                      \
        a0 = _mm512_dpbusd_epi32(a0, lo_v, de), b0 = _mm512_dpbusd_epi32(b0, lo_w, de);                        \
        a0 = _mm512_dpbusd_epi32(a0, hi_v, d_o), b0 = _mm512_dpbusd_epi32(b0, hi_w, d_o);                      \
        de = _mm512_load_si512(xe + 64), d_o = _mm512_load_si512(xo + 64);                                    \
        a1 = _mm512_dpbusd_epi32(a1, lo_v, de), b1 = _mm512_dpbusd_epi32(b1, lo_w, de);                        \
        a1 = _mm512_dpbusd_epi32(a1, hi_v, d_o), b1 = _mm512_dpbusd_epi32(b1, hi_w, d_o);                      \
        de = _mm512_load_si512(xe + 128), d_o = _mm512_load_si512(xo + 128);                                  \
        a2 = _mm512_dpbusd_epi32(a2, lo_v, de), b2 = _mm512_dpbusd_epi32(b2, lo_w, de);                        \
        a2 = _mm512_dpbusd_epi32(a2, hi_v, d_o), b2 = _mm512_dpbusd_epi32(b2, hi_w, d_o);                      \
        de = _mm512_load_si512(xe + 192), d_o = _mm512_load_si512(xo + 192);                                  \
        a3 = _mm512_dpbusd_epi32(a3, lo_v, de), b3 = _mm512_dpbusd_epi32(b3, lo_w, de);                        \
        a3 = _mm512_dpbusd_epi32(a3, hi_v, d_o), b3 = _mm512_dpbusd_epi32(b3, hi_w, d_o);                      \
    } while (0)

/* Rows o and o + 1's span of n blocks from block b (the f-th span), flushed into t. n is a constant where it is
 * called, so each register stays one (an array indexed by a loop the compiler kept would live in memory). */
static inline __attribute__((always_inline)) void int4_span(const matrix *m, const row_digits *r, row_sums *t,
                                                            float row_s, int o, int b, int f, int n, int64_t ahead) {
    int in = m->in;
    const uint8_t *p = (const uint8_t *)m->codes + (int64_t)o * (in / 2), *p1 = p + in / 2;
    __m512i low = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512(), v[SPAN], w[SPAN];
    for (int j = 0; j < n; j++) {
        _mm_prefetch((const char *)p + ahead + 64 * (b + j), _MM_HINT_T1);
        _mm_prefetch((const char *)p1 + ahead + 64 * (b + j), _MM_HINT_T1);
        v[j] = load_block(p, b + j, in), w[j] = load_block(p1, b + j, in);
    }
    gather_units(v, n), gather_units(w, n);
    __m512i a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    for (int j = 0; j < n; j++)
        INT4_DOT(v[j], w[j], r->xe + (b + j) * DIGITS * 64, r->xo + (b + j) * DIGITS * 64);
    flush(m, r, t, o, f, row_s, a0, a1, a2, a3, b0, b1, b2, b3);
}

/* Rows o and o + 1's float64 sums, lane by lane, into wide[0] and wide[1]. */
static void int4_rows(const matrix *m, const row_digits *r, float row_s, double (*wide)[16], int o) {
    int blocks = (m->in + 127) / 128, half = m->in / 2, b = 0, f = 0;
    int64_t ahead = o + 2 + r->rows_ahead <= m->out ? (int64_t)r->rows_ahead * half : 0;
    row_sums t;
    t.wide = wide;
    memset(wide, 0, 2 * sizeof *wide);
    t.acc0 = t.acc1 = _mm512_setzero_ps();
    t.window = -16, t.flushes = 0;
    /* span_at's spans, written out: each call's n a constant (a loop over span_at took 1.03-1.06x at 576 columns) */
    for (; b + SPAN <= blocks; b += SPAN, f++) int4_span(m, r, &t, row_s, o, b, f, SPAN, ahead);
    if (blocks - b >= 2) int4_span(m, r, &t, row_s, o, b, f++, 2, ahead), b += 2;
    if (blocks - b == 1) int4_span(m, r, &t, row_s, o, b, f++, 1, ahead);
    add_wide(t.wide[0], t.acc0), add_wide(t.wide[1], t.acc1);
}

#define CHUNK 32  /* rows whose sums are reduced together */

/* y[o0 .. o1 - 1] (up to CHUNK rows): the rows' sums, then each reduced to one value. A row pair's last flush and
 * its sums' reduction are a chain of dependent instructions ~100 cycles long; reduced a row pair at a time it held
 * up the next pair (SmolLM2-135M's 960 x 576 matrix at one row, one thread, a scratch copy: 26.6 -> 23.3-24.3 us). */
static void int4_chunk(const matrix *m, const row_digits *r, float row_s, float *y, int o0, int o1) {
    double wide[CHUNK][16] __attribute__((aligned(64)));
    for (int o = o0; o < o1; o += 2) int4_rows(m, r, row_s, wide + (o - o0), o);
    for (int o = o0; o < o1; o++) {
        __m512d sum = _mm512_add_pd(_mm512_load_pd(wide[o - o0]), _mm512_load_pd(wide[o - o0] + 8));
        y[o] = (float)(_mm512_reduce_add_pd(sum) * (256.0 / BASE));
    }
}

/* y [1, out] = x [1, in] @ ŵᵀ for int4 codes (out even, in and group multiples of 64). Returns 1 when x's digits
 * cannot be allocated. */
static int int4_one_row(const float *x, const matrix *m, float *y, int threads) {
    int in = m->in, blocks = (in + 127) / 128;
    size_t plane = (size_t)blocks * DIGITS * 64;
    int8_t *digits = (int8_t *)malloc((size_t)DIGITS * in);
    row_digits r = {(int8_t *)aligned_alloc(64, plane), (int8_t *)aligned_alloc(64, plane),
                    (float *)aligned_alloc(64, sizeof(float) * 2 * 16 * blocks),
                    (int32_t *)aligned_alloc(64, sizeof(int32_t) * 16 * blocks), (int *)malloc(sizeof(int) * blocks)};
    int failed = !digits || !r.xe || !r.xo || !r.sums || !r.lane_group || !r.group0;
    float row_s = 0.0f;
    if (!failed) {
        digits_of(x, digits, &row_s, 0, in);
        lay_out_digits(digits, &r, in, m->group);
        r.groups = in / m->group, r.rows_ahead = rows_ahead(in / 2, 2);
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int o = 0; o < m->out; o += CHUNK) int4_chunk(m, &r, row_s, y, o, o + CHUNK < m->out ? o + CHUNK : m->out);
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
    if (in < 64 || in % 64 || in > MAX_IN || out < 1 || out % 2 || group < 64 || group % 64 || in % group)
        return 2;
    matrix m = {packed, scale, zero, out, in, group};
    return int4_one_row(x, &m, y, threads);
#else
    (void)x, (void)packed, (void)scale, (void)zero, (void)y, (void)out, (void)in, (void)group, (void)threads;
    return 2;
#endif
}
