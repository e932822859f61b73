/* Prefill's causal attention in bfloat16: flash attention (Dao et al. 2022) with both of its products on pairs of
 * bfloat16s, on the CPU's matrix units (Intel AMX) where it has them, else by AVX512-BF16's dot products. The T
 * queries are the last T of the S positions; query t (position S - T + t) attends over the keys j <= S - T + t:
 *
 *   out[h, t] = Σ_j softmax_j(scale · q[h, t]·k[h/G, j]) · v[h/G, j]           (G = H / KV, GQA)
 *
 * A task is one head's block of 16 queries. It walks the keys 32 at a time with the online softmax (Milakov &
 * Gimelshein 2018), m the running maximum and l the running sum of each query:
 *
 *   Sᵀ [32 keys, 16 queries] = K · Qᵀ           tiles: bfloat16 pairs in, float32 sums (exact products)
 *   m' = max(m, max_j scale · Sᵀ[j]),  p_j = exp(scale · Sᵀ[j] - m'),  c = exp(m - m')
 *   l = c · l + Σ_j p_j,   Oᵀ [D, 16] = c · Oᵀ + Vᵀ · bf16(p)       (p rounded to bfloat16 for the tiles, as
 *                                                                    SDPA's flash kernel rounds it too)
 *   out = bf16(O / l)
 *
 * Transposed so that a vector holds one key's scores for the block's 16 queries: the softmax's maxima and sums
 * run across vectors, lane by lane, with no reduction inside a vector (each of which waits on the last). A tile
 * product's B operand wants "VNNI" pairs (B[k/2][n][2]): Qᵀ's dim pairs, and p's key pairs; the A operands are
 * rows: K's as they lie (copied once a call into a buffer padded with zero keys), and Vᵀ's (packed once a call).
 * Without the tiles (an AMD Zen 4, an Intel Xeon before Sapphire Rapids) the same layouts feed pairs_product, a tile
 * product made of _mm512_dpbf16_ps: each pair of A's row broadcast, times B's row of pairs, summed in float32 into
 * one vector of C's row. It computes the same sums in the same order as a tile (the products of bfloat16 pairs are
 * exact in float32), and took 1.02 against 2.31 ms for the float32 loop of attention.c at T = S = 480 (9 heads over
 * 3, head_dim 64, 2 threads, the AMD EPYC, 2026-12-06). tests/fast/test_attention_bf16.py checks both against
 * attention in float64 on the same bfloat16 numbers.
 *
 * Built where the compiler targets AVX512-BF16 (the tiles: AMX-BF16 too, as bf16_amx.c); head_dim a multiple of 32,
 * at most 256.
 */
#include "common.h"

#if defined(__AVX512BF16__)
#define ATTENTION_PAIRS 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define ATTENTION_AMX 1
#include "amx.h"
#endif

enum { KB = 32 };  /* keys a step: two score tiles */

/* 16 rows of 32 bfloat16s (`stride` elements apart, zeros past row n - 1) as a B tile: row p holds elements 2p,
 * 2p + 1 of each row, side by side (a 16x16 transpose of 32-bit pairs). */
static void pairs_tile(const uint16_t *x, int64_t stride, int n, uint32_t *tile) {
    __m512 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = i < n ? _mm512_castsi512_ps(_mm512_loadu_si512(x + i * stride)) : _mm512_setzero_ps();
    transpose16(r);
    for (int p = 0; p < 16; p++) _mm512_store_ps((float *)(tile + 16 * p), r[p]);
}

/* 16 bfloat16s of a and of b interleaved: a0 b0 a1 b1 ... (a VNNI row) */
static inline __m512i interleave16(__m256i a, __m256i b) {
    __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                     23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

/* One K/V head for a call: kp [S_pad, D] the keys with zero rows to a multiple of KB (an A operand as it lies);
 * vt per block of 32 keys and 16 dims a tile of Vᵀ (row d: the 32 keys' values of dim d). */
static void pack_head(const uint16_t *k, int64_t k_row, const uint16_t *v, int64_t v_row, int S, int D, int steps,
                      uint16_t *kp, uint16_t *vt) {
    for (int j = 0; j < steps * KB; j++) {
        if (j < S) memcpy(kp + (int64_t)j * D, k + j * k_row, 2 * (size_t)D);
        else memset(kp + (int64_t)j * D, 0, 2 * (size_t)D);
    }
    for (int b = 0; b < steps; b++)
        for (int e = 0; e < D / 16; e++) {
            __m512 r[16];  /* r[i]: keys 2i, 2i + 1 of the block side by side, for each of the 16 dims */
            for (int i = 0; i < 16; i++) {
                int j = KB * b + 2 * i;
                __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
                if (j < S) lo = _mm256_loadu_si256((const __m256i *)(v + j * v_row + 16 * e));
                if (j + 1 < S) hi = _mm256_loadu_si256((const __m256i *)(v + (j + 1) * v_row + 16 * e));
                r[i] = _mm512_castsi512_ps(interleave16(lo, hi));
            }
            transpose16(r);  /* r[d]: dim d's values of the 32 keys, in key order */
            uint16_t *tile = vt + ((int64_t)b * (D / 16) + e) * 512;
            for (int d = 0; d < 16; d++) _mm512_store_ps((float *)(tile + 32 * d), r[d]);
        }
}

/* The online softmax's step over 32 keys for the block's 16 queries (lanes): st [32][16] the raw scores Sᵀ in; pt
 * the bfloat16 weights out as a B tile (row i: keys 2i, 2i + 1 side by side for each query); m, l updated. Key
 * first_key + j is visible to a query up to its position (pos). m moves only where a score passes it by more than
 * LAZY (the weights then reach e^LAZY at most, far inside float32 and bfloat16): softmax is the same from any m, and
 * Oᵀ is rescaled only on the steps where m moves (FlashAttention-3's trick; with m the exact maximum, nearly every
 * early step would rescale). Returns c, the factor Oᵀ's columns are rescaled by (1 where m stays). */
enum { LAZY = 8 };

static __m512 softmax_step(const float *st, uint32_t *pt, __m512 *m, __m512 *l, float scale, int first_key,
                           __m512i pos) {
    __m512 s[KB], sc = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-INFINITY), top = neg;
    for (int j = 0; j < KB; j++) {
        __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_set1_epi32(first_key + j), pos);
        s[j] = _mm512_mask_mul_ps(neg, seen, _mm512_load_ps(st + 16 * j), sc);
        top = _mm512_max_ps(top, s[j]);
    }
    __mmask16 moves = _mm512_cmp_ps_mask(top, _mm512_add_ps(*m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ);
    __m512 m_new = _mm512_mask_mov_ps(*m, moves, top);
    __m512 c = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), moves, exp16(_mm512_sub_ps(*m, m_new)));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < KB; j += 2) {
        __m512 a = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(s[j], neg), exp16(_mm512_sub_ps(s[j], m_new)));
        __m512 b = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(s[j + 1], neg), exp16(_mm512_sub_ps(s[j + 1], m_new)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
        __m256i ra = (__m256i)_mm512_cvtneps_pbh(a), rb = (__m256i)_mm512_cvtneps_pbh(b);
        _mm512_store_si512(pt + 8 * j, interleave16(ra, rb));
    }
    *l = _mm512_fmadd_ps(*l, c, sum);
    *m = m_new;
    return c;
}

#if defined(ATTENTION_AMX)
static inline void store_resident(float *ot) {  /* Oᵀ's tiles 4-7 (head_dim 64) into ot */
    _tile_stored(4, ot, 64);
    _tile_stored(5, ot + 256, 64);
    _tile_stored(6, ot + 512, 64);
    _tile_stored(7, ot + 768, 64);
}

#endif

static void rescale(float *o, __m512 c) {  /* an Oᵀ tile's 16 rows (dims), lane by lane (queries) */
    for (int d = 0; d < 16; d++) _mm512_store_ps(o + 16 * d, _mm512_mul_ps(_mm512_load_ps(o + 16 * d), c));
}

/* Oᵀ [D][16] back to the block's rows of out (o_row elements apart), each divided by its l, rounded to bfloat16 */
static void store_output(const float *ot, __m512 l, int rows, int D, uint16_t *out, int64_t o_row) {
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int e = 0; e < D / 16; e++) {  /* Oᵀ's 16x16 blocks back to rows */
        __m512 r[16];
        for (int d = 0; d < 16; d++) r[d] = _mm512_mul_ps(_mm512_load_ps(ot + 256 * e + 16 * d), inv);
        transpose16(r);
        for (int i = 0; i < rows; i++)
            _mm256_storeu_si256((__m256i *)(out + i * o_row + 16 * e), (__m256i)_mm512_cvtneps_pbh(r[i]));
    }
}

/* The start of a task (head h's queries t0 .. t0 + 15): Qᵀ packed into qt, Oᵀ (ot) zeroed, *rows the block's real
 * queries; returns each lane's query position (lanes past T - 1: S - 1). */
static __m512i start_block(const uint16_t *q, int64_t q_head, int64_t q_row, int h, int t0, int T, int S, int D,
                           uint32_t *qt, float *ot, int *rows) {
    *rows = T - t0 < 16 ? T - t0 : 16;
    const uint16_t *queries = q + h * q_head + (int64_t)t0 * q_row;
    for (int c = 0; c < D / 32; c++) pairs_tile(queries + 32 * c, q_row, *rows, qt + 256 * c);
    memset(ot, 0, sizeof(float) * 16 * (size_t)D);
    __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(S - T + t0), lanes), _mm512_set1_epi32(S - 1));
}

/* A tile product by vectors: c [16][16] += a's 16 rows (a_row elements apart) of 32 bfloat16s · b, 16 rows of
 * pairs (a B tile, "VNNI": b[p][n] holds the pair 2p, 2p + 1 of column n). Row i of c is one vector: each pair of a's
 * row i broadcast, _mm512_dpbf16_ps with b's row p. (The pair is copied out with memcpy: GCC 12 sent a cast
 * load of a bfloat16 vector through the stack.) */
static inline void pairs_product(const uint16_t *a, int64_t a_row, const uint32_t *b, float *c) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_load_ps(c + 16 * i);
    for (int p = 0; p < 16; p++) {
        __m512bh bp = (__m512bh)_mm512_load_si512(b + 16 * p);
        for (int i = 0; i < 16; i++) {
            int pair;
            memcpy(&pair, a + i * a_row + 2 * p, 4);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), bp);
        }
    }
    for (int i = 0; i < 16; i++) _mm512_store_ps(c + 16 * i, acc[i]);
}

#if defined(ATTENTION_AMX)
/* One task: head h's queries t0 .. t0 + 15 (rows past T - 1 computed on zeros and dropped). Tiles: 0, 1 Sᵀ; 2 a Qᵀ
 * tile; 3 a K tile; then 2 the p tile, 3 a Vᵀ tile, 4-7 Oᵀ's (head_dim 64: held across the steps; else one at a
 * time, through memory). */
static void query_block(const uint16_t *q, int64_t q_head, int64_t q_row, const uint16_t *kp, const uint16_t *vt,
                        uint16_t *out, int64_t o_head, int64_t o_row, int h, int t0, int T, int S, int D,
                        float scale) {
    uint32_t qt[8 * 256] __attribute__((aligned(64)));  /* Qᵀ: a B tile a 32 dims */
    uint32_t pt[256] __attribute__((aligned(64)));
    float st[KB * 16] __attribute__((aligned(64))), ot[256 * 16] __attribute__((aligned(64)));  /* Oᵀ [D][16] */
    int rows;
    __m512i pos = start_block(q, q_head, q_row, h, t0, T, S, D, qt, ot, &rows);
    int last_pos = S - T + t0 + rows - 1;
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    int resident = D == 64;  /* Oᵀ's four tiles held in tiles 4-7 across the steps */
    if (resident) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int step = 0; step <= last_pos / KB; step++) {
        const uint16_t *keys = kp + (int64_t)step * KB * D, *values = vt + (int64_t)step * (D / 16) * 512;
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < D / 32; c++) {
            _tile_loadd(2, qt + 256 * c, 64);
            _tile_loadd(3, keys + 32 * c, 2 * D);
            _tile_dpbf16ps(0, 3, 2);
            _tile_loadd(3, keys + 16 * D + 32 * c, 2 * D);
            _tile_dpbf16ps(1, 3, 2);
        }
        _tile_stored(0, st, 64);
        _tile_stored(1, st + 256, 64);
        __m512 c = softmax_step(st, pt, &m, &l, scale, KB * step, pos);
        int moved = step > 0 && _mm512_cmpneq_ps_mask(c, _mm512_set1_ps(1.0f));  /* (step 0: Oᵀ is zero) */
        _tile_loadd(2, pt, 64);
        if (resident) {
            if (moved) {
                store_resident(ot);
                for (int e = 0; e < 4; e++) rescale(ot + 256 * e, c);
                _tile_loadd(4, ot, 64);
                _tile_loadd(5, ot + 256, 64);
                _tile_loadd(6, ot + 512, 64);
                _tile_loadd(7, ot + 768, 64);
            }
            _tile_loadd(3, values, 64);
            _tile_dpbf16ps(4, 3, 2);
            _tile_loadd(3, values + 512, 64);
            _tile_dpbf16ps(5, 3, 2);
            _tile_loadd(3, values + 1024, 64);
            _tile_dpbf16ps(6, 3, 2);
            _tile_loadd(3, values + 1536, 64);
            _tile_dpbf16ps(7, 3, 2);
            continue;
        }
        for (int e = 0; e < D / 16; e++) {
            float *o = ot + 256 * e;
            if (moved) rescale(o, c);
            _tile_loadd(4, o, 64);
            _tile_loadd(3, values + 512 * e, 64);
            _tile_dpbf16ps(4, 3, 2);
            _tile_stored(4, o, 64);
        }
    }
    if (resident) store_resident(ot);
    store_output(ot, l, rows, D, out + h * o_head + (int64_t)t0 * o_row, o_row);
}
#endif

/* The same task without the tiles: Sᵀ, and Oᵀ a 16 dims at a time, by pairs_product; Oᵀ [D][16] in memory. */
static void query_block_vectors(const uint16_t *q, int64_t q_head, int64_t q_row, const uint16_t *kp,
                                const uint16_t *vt, uint16_t *out, int64_t o_head, int64_t o_row, int h, int t0, int T,
                                int S, int D, float scale) {
    uint32_t qt[8 * 256] __attribute__((aligned(64)));  /* Qᵀ: a B tile a 32 dims */
    uint32_t pt[256] __attribute__((aligned(64)));
    float st[KB * 16] __attribute__((aligned(64))), ot[256 * 16] __attribute__((aligned(64)));  /* Oᵀ [D][16] */
    int rows;
    __m512i pos = start_block(q, q_head, q_row, h, t0, T, S, D, qt, ot, &rows);
    int last_pos = S - T + t0 + rows - 1;
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int step = 0; step <= last_pos / KB; step++) {
        const uint16_t *keys = kp + (int64_t)step * KB * D, *values = vt + (int64_t)step * (D / 16) * 512;
        memset(st, 0, sizeof st);
        for (int c = 0; c < D / 32; c++) {
            pairs_product(keys + 32 * c, D, qt + 256 * c, st);
            pairs_product(keys + 16 * D + 32 * c, D, qt + 256 * c, st + 256);
        }
        __m512 c = softmax_step(st, pt, &m, &l, scale, KB * step, pos);
        int moved = step > 0 && _mm512_cmpneq_ps_mask(c, _mm512_set1_ps(1.0f));  /* (step 0: Oᵀ is zero) */
        for (int e = 0; e < D / 16; e++) {
            if (moved) rescale(ot + 256 * e, c);
            pairs_product(values + 512 * e, 32, pt, ot + 256 * e);
        }
    }
    store_output(ot, l, rows, D, out + h * o_head + (int64_t)t0 * o_row, o_row);
}
#endif

/* Whether this build can run the tiles (AMX-BF16, and Linux granted them) */
static int tiles_here(void) {
#if defined(ATTENTION_AMX)
    return amx_granted();
#else
    return 0;
#endif
}

/* q [H, T, D], k and v [KV, S, D], out [H, T, D], bfloat16, at the given element strides (a head's, a row's; a
 * row's D elements contiguous); `tiles`: on the matrix units (else by vectors). Returns 0; 1 when the packed K and V
 * cannot be allocated; 2 for shapes it does not take (D % 32, D > 256, T > S, H % KV), where it is not built
 * (bf16_dot_instructions() == 0) or, with tiles, where they are not (bf16_amx_ready() == 0). The caller's tile
 * configuration is put back after. */
int causal_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int H, int KV, int T,
                          int S, int D, int64_t q_head, int64_t q_row, int64_t k_head, int64_t k_row, int64_t v_head,
                          int64_t v_row, int64_t o_head, int64_t o_row, float scale, int tiles, int threads) {
#if defined(ATTENTION_PAIRS)
    if (D % 32 || D > 256 || T < 1 || T > S || KV < 1 || H % KV || (tiles && !tiles_here())) return 2;
    int steps = (S + KB - 1) / KB, G = H / KV, blocks = (T + 15) / 16;
    int64_t head_size = (int64_t)steps * KB * D;  /* bfloat16s of one K/V head's kp, and of its vt */
    uint16_t *kp = aligned_alloc(64, (size_t)KV * head_size * 2), *vt = aligned_alloc(64, (size_t)KV * head_size * 2);
    if (!kp || !vt) {
        free(kp);
        free(vt);
        return 1;
    }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int kvh = 0; kvh < KV; kvh++)
            pack_head(k + kvh * k_head, k_row, v + kvh * v_head, v_row, S, D, steps, kp + kvh * head_size,
                      vt + kvh * head_size);
#if defined(ATTENTION_AMX)
        tile_config saved;
        if (tiles) amx_configure(&saved);
#endif
        #pragma omp for schedule(dynamic)
        for (int task = 0; task < H * blocks; task++) {  /* the last blocks first: they see the most keys */
            int h = task % H, t0 = 16 * (blocks - 1 - task / H);
            const uint16_t *kh = kp + (h / G) * head_size, *vh = vt + (h / G) * head_size;
#if defined(ATTENTION_AMX)
            if (tiles) {
                query_block(q, q_head, q_row, kh, vh, out, o_head, o_row, h, t0, T, S, D, scale);
                continue;
            }
#endif
            query_block_vectors(q, q_head, q_row, kh, vh, out, o_head, o_row, h, t0, T, S, D, scale);
        }
#if defined(ATTENTION_AMX)
        if (tiles) amx_restore(&saved);
#endif
    }
    free(kp);
    free(vt);
    return 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)H, (void)KV, (void)T, (void)S, (void)D, (void)q_head, (void)q_row;
    (void)k_head, (void)k_row, (void)v_head, (void)v_row, (void)o_head, (void)o_row, (void)scale, (void)tiles;
    (void)threads, (void)tiles_here;
    return 2;
#endif
}
