/* Prefill's causal attention in bfloat16 on the CPU's matrix units (Intel AMX): flash attention (Dao et al. 2022)
 * with both of its products on the tiles. The T queries are the last T of the S positions; query t (position
 * S - T + t) attends over the keys j <= S - T + t:
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
 * tests/fast/test_attention_amx.py checks the result against attention in float64 on the same bfloat16 numbers.
 *
 * Built only where the compiler targets AMX-BF16 (as bf16_amx.c); head_dim a multiple of 32, at most 256.
 */
#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define ATTENTION_AMX 1
#include "amx.h"

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
 * first_key + j is visible to a query from key lo up to its position (pos). m moves only where a score passes it
 * by more than LAZY (the weights then reach e^LAZY at most, far inside float32 and bfloat16): softmax is the same
 * from any m, and Oᵀ is rescaled only on the steps where m moves (FlashAttention-3's trick; with m the exact
 * maximum, nearly every early step would rescale). Returns c, the factor Oᵀ's columns are rescaled by (1 where m
 * stays). */
enum { LAZY = 8 };

static __m512 softmax_step(const float *st, uint32_t *pt, __m512 *m, __m512 *l, float scale, int first_key,
                           int lo, __m512i pos) {
    __m512 s[KB], sc = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-INFINITY), top = neg;
    for (int j = 0; j < KB; j++) {  /* (keys before lo: a decode's sliding window, or a step's first block) */
        __mmask16 seen = first_key + j >= lo ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(first_key + j), pos) : 0;
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

static inline void store_resident(float *ot) {  /* Oᵀ's tiles 4-7 (head_dim 64) into ot */
    _tile_stored(4, ot, 64);
    _tile_stored(5, ot + 256, 64);
    _tile_stored(6, ot + 512, 64);
    _tile_stored(7, ot + 768, 64);
}

static void rescale(float *o, __m512 c) {  /* an Oᵀ tile's 16 rows (dims), lane by lane (queries) */
    for (int d = 0; d < 16; d++) _mm512_store_ps(o + 16 * d, _mm512_mul_ps(_mm512_load_ps(o + 16 * d), c));
}

/* One task: head h's queries t0 .. t0 + 15 (rows past T - 1 computed on zeros and dropped). Tiles: 0, 1 Sᵀ; 2 a Qᵀ
 * tile; 3 a K tile; then 2 the p tile, 3 a Vᵀ tile, 4-7 Oᵀ's (head_dim 64: held across the steps; else one at a
 * time, through memory). */
static void query_block(const uint16_t *q, int64_t q_head, int64_t q_row, const uint16_t *kp, const uint16_t *vt,
                        uint16_t *out, int64_t o_head, int64_t o_row, int h, int t0, int T, int S, int D,
                        float scale) {
    uint32_t qt[8 * 256] __attribute__((aligned(64)));  /* Qᵀ: a B tile a 32 dims */
    uint32_t pt[256] __attribute__((aligned(64)));
    float st[KB * 16] __attribute__((aligned(64))), ot[256 * 16] __attribute__((aligned(64)));  /* Oᵀ [D][16] */
    int rows = T - t0 < 16 ? T - t0 : 16;
    const uint16_t *queries = q + h * q_head + (int64_t)t0 * q_row;
    for (int c = 0; c < D / 32; c++) pairs_tile(queries + 32 * c, q_row, rows, qt + 256 * c);
    memset(ot, 0, sizeof(float) * 16 * (size_t)D);
    int first_pos = S - T + t0, last_pos = first_pos + rows - 1;
    __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(first_pos), lanes), _mm512_set1_epi32(S - 1));
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
        __m512 c = softmax_step(st, pt, &m, &l, scale, KB * step, 0, pos);
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
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int e = 0; e < D / 16; e++) {  /* Oᵀ's 16x16 blocks back to rows, each divided by its l */
        __m512 r[16];
        for (int d = 0; d < 16; d++) r[d] = _mm512_mul_ps(_mm512_load_ps(ot + 256 * e + 16 * d), inv);
        transpose16(r);
        for (int i = 0; i < rows; i++)
            _mm256_storeu_si256((__m256i *)(out + h * o_head + (int64_t)(t0 + i) * o_row + 16 * e),
                                (__m256i)_mm512_cvtneps_pbh(r[i]));
    }
}
/* Decode's attention over a paged pool (paged_decode_attention's, in bfloat16), on the tiles. A decode step has one
 * query a head, so query_block's 16 queries become the heads of a group of K/V heads (all 9 of SmolLM2-135M's over
 * 3). The pool's K rows are the A operand as they lie (a piece: 16 keys of one block, `row` elements apart); Qᵀ is a
 * B tile a K/V head with the other heads' queries zero, so that the group's products add into one Sᵀ tile, each
 * query's column over its own head's keys:
 *
 *   Sᵀ [32 keys, 16 queries] = Σ_kvh K_kvh · Qᵀ_kvh
 *   O  [16 queries, D]       = c · O + Σ_kvh P_kvh · V_kvh     (P_kvh: p's rows of head kvh's queries, others zero)
 *
 * with softmax_step's online softmax, lane by lane. O is not transposed here (P·V, where query_block has Vᵀ·Pᵀ):
 * the pool is read once a step, so V is packed every time, and its key pairs (the B operand) are two rows unpacked,
 * where Vᵀ would take a 16x16 transpose a K/V head and 16 dims; P takes one transpose a step for all heads. The
 * unpacking leaves the dims in its own order (4 of every 8 in each tile), put back once at the end. */
enum { GROUP_ROWS = 16 };  /* queries a task: one tile's rows */

/* Qᵀ of a group's n queries (rows of q, D apart; query i of K/V head i / G) as a B tile a K/V head and 32 dims: tile
 * (kvh, c), row p: dims 32c + 2p, 32c + 2p + 1 of each of head kvh's queries, zeros in the other lanes */
static void query_pairs(const uint16_t *q, int n, int G, int g, int D, uint32_t *qt) {
    uint32_t all[256] __attribute__((aligned(64)));
    for (int c = 0; c < D / 32; c++) {
        pairs_tile(q + 32 * c, D, n, all);
        for (int kvh = 0; kvh < g; kvh++) {
            __mmask16 mine = (__mmask16)(((1u << G) - 1) << (kvh * G));
            for (int p = 0; p < 16; p++)
                _mm512_store_si512(qt + (kvh * (D / 32) + c) * 256 + 16 * p,
                                   _mm512_maskz_mov_epi32(mine, _mm512_load_si512(all + 16 * p)));
        }
    }
}

/* One K/V head's values of a step's 32 keys as D / 16 B tiles. v0, v1: the head's rows of the step's two pieces (v1
 * NULL past the last key). Tile 2c + half, row i: keys 2i, 2i + 1 side by side for 16 dims of the chunk 32c .. 32c +
 * 31 (half 0: its dims 0-3, 8-11, 16-19, 24-27, as _mm512_unpacklo_epi16 leaves them; half 1 the others). Keys
 * outside [lo, hi) are zeros: a pool's other rows may hold anything, and 0 · NaN is NaN. */
static void value_pairs(const uint16_t *v0, const uint16_t *v1, int64_t row, int64_t first_key, int64_t lo,
                        int64_t hi, int D, uint16_t *vt) {
    for (int i = 0; i < 16; i++) {
        int64_t a = first_key + 2 * i;
        const uint16_t *ra = 2 * i < 16 ? v0 + 2 * i * row : v1 ? v1 + (2 * i - 16) * row : NULL;
        int use_a = ra && a >= lo && a < hi, use_b = ra && a + 1 >= lo && a + 1 < hi;
        for (int c = 0; c < D / 32; c++) {
            __m512i x = use_a ? _mm512_loadu_si512(ra + 32 * c) : _mm512_setzero_si512();
            __m512i y = use_b ? _mm512_loadu_si512(ra + row + 32 * c) : _mm512_setzero_si512();
            _mm512_store_si512(vt + 2 * c * 512 + 32 * i, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(vt + (2 * c + 1) * 512 + 32 * i, _mm512_unpackhi_epi16(x, y));
        }
    }
}

/* softmax_step's weights (a B tile: row i keys 2i, 2i + 1 of each query) as P's rows (row n: query n's 32 keys in
 * order), one A tile a K/V head holding its own queries' rows, zeros in the others */
static void weight_rows(const uint32_t *pt, int G, int g, uint32_t *ptiles) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps((const float *)(pt + 16 * i));
    transpose16(r);
    for (int kvh = 0; kvh < g; kvh++)
        for (int n = 0; n < 16; n++)
            _mm512_store_ps((float *)(ptiles + kvh * 256 + 16 * n), n / G == kvh ? r[n] : _mm512_setzero_ps());
}

static void rescale_rows(float *o, __m512 c) {  /* an O tile's 16 rows (queries), row n times c's lane n */
    float f[16];
    _mm512_storeu_ps(f, c);
    for (int n = 0; n < 16; n++)
        _mm512_store_ps(o + 16 * n, _mm512_mul_ps(_mm512_load_ps(o + 16 * n), _mm512_set1_ps(f[n])));
}

/* The address of key `key`'s row in a pool, through the block table */
static inline const uint16_t *pool_row(const uint16_t *pool, const int64_t *table, int64_t key, int block_size,
                                       int64_t row) {
    return pool + (table[key / block_size] * block_size + key % block_size) * row;
}

typedef struct {  /* a thread's scratch: Qᵀ's tiles, V's tiles, the weights both ways, the scores, O */
    uint32_t *qt, *vt, *pt, *ptiles;
    float *st, *ot;
} decode_scratch;

/* One task: the queries of K/V heads kvh0 .. kvh0 + g - 1 of one sequence (q, out: its [heads, D] rows), over its
 * keys first <= j < last, 32 keys a step from the piece that holds `first` */
static void decode_group(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, uint16_t *out,
                         const int64_t *table, int64_t first, int64_t last, int kvh0, int g, int G, int kv_heads,
                         int D, int block_size, float scale, const decode_scratch *w) {
    int n = g * G, resident = D == 64;
    int64_t row = (int64_t)kv_heads * D;
    query_pairs(q + (int64_t)kvh0 * G * D, n, G, g, D, w->qt);
    memset(w->ot, 0, sizeof(float) * 16 * (size_t)D);
    if (resident) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    }
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    __m512i pos = _mm512_set1_epi32((int)(last - 1));
    for (int64_t key = first / 16 * 16; key < last; key += KB) {
        const uint16_t *k0 = pool_row(k_pool, table, key, block_size, row);
        const uint16_t *v0 = pool_row(v_pool, table, key, block_size, row), *k1 = NULL, *v1 = NULL;
        if (key + 16 < last) {
            k1 = pool_row(k_pool, table, key + 16, block_size, row);
            v1 = pool_row(v_pool, table, key + 16, block_size, row);
        }
        /* the next step's rows, asked for now: blocks lie anywhere in the pool, where the CPU's own prefetcher does not
         * look (a server's batch-32 decode step, SmolLM2-135M: this layer's attention 16.5 -> 15.5 ms) */
        for (int64_t next = key + KB; next < key + 2 * KB && next < last; next += 16) {
            int64_t col = (int64_t)kvh0 * D, bytes = (int64_t)g * D * 2;
            for (int j = 0; j < 16; j++) {
                prefetch_bytes(pool_row(k_pool, table, next, block_size, row) + j * row + col, bytes);
                prefetch_bytes(pool_row(v_pool, table, next, block_size, row) + j * row + col, bytes);
            }
        }
        _tile_zero(0);
        _tile_zero(1);
        for (int kvh = 0; kvh < g; kvh++)
            for (int c = 0; c < D / 32; c++) {
                int64_t col = (int64_t)(kvh0 + kvh) * D + 32 * c;
                _tile_loadd(3, w->qt + (kvh * (D / 32) + c) * 256, 64);
                _tile_loadd(2, k0 + col, 2 * row);
                _tile_dpbf16ps(0, 2, 3);
                if (k1) {
                    _tile_loadd(2, k1 + col, 2 * row);
                    _tile_dpbf16ps(1, 2, 3);
                }
            }
        _tile_stored(0, w->st, 64);
        _tile_stored(1, w->st + 256, 64);
        __m512 c = softmax_step(w->st, w->pt, &m, &l, scale, (int)key, (int)first, pos);
        int moved = key >= first / 16 * 16 + KB && _mm512_cmpneq_ps_mask(c, _mm512_set1_ps(1.0f));
        weight_rows(w->pt, G, g, w->ptiles);
        if (moved) {
            if (resident) store_resident(w->ot);
            for (int e = 0; e < D / 16; e++) rescale_rows(w->ot + 256 * e, c);
            if (resident) {
                _tile_loadd(4, w->ot, 64);
                _tile_loadd(5, w->ot + 256, 64);
                _tile_loadd(6, w->ot + 512, 64);
                _tile_loadd(7, w->ot + 768, 64);
            }
        }
        for (int kvh = 0; kvh < g; kvh++) {
            int64_t col = (int64_t)(kvh0 + kvh) * D;
            value_pairs(v0 + col, v1 ? v1 + col : NULL, row, key, first, last, D, (uint16_t *)w->vt);
            _tile_loadd(2, w->ptiles + 256 * kvh, 64);
            if (resident) {
                _tile_loadd(3, w->vt, 64);
                _tile_dpbf16ps(4, 2, 3);
                _tile_loadd(3, w->vt + 256, 64);
                _tile_dpbf16ps(5, 2, 3);
                _tile_loadd(3, w->vt + 512, 64);
                _tile_dpbf16ps(6, 2, 3);
                _tile_loadd(3, w->vt + 768, 64);
                _tile_dpbf16ps(7, 2, 3);
                continue;
            }
            for (int e = 0; e < D / 16; e++) {
                _tile_loadd(4, w->ot + 256 * e, 64);
                _tile_loadd(3, w->vt + 256 * e, 64);
                _tile_dpbf16ps(4, 2, 3);
                _tile_stored(4, w->ot + 256 * e, 64);
            }
        }
    }
    if (resident) store_resident(w->ot);
    __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int i = 0; i < n; i++)  /* each query's dims back in order, divided by its l */
        for (int c = 0; c < D / 32; c++) {
            __m512 lo = _mm512_load_ps(w->ot + 512 * c + 16 * i), hi = _mm512_load_ps(w->ot + 512 * c + 256 + 16 * i);
            __m512 s = _mm512_set1_ps(inv[i]);
            uint16_t *o = out + ((int64_t)kvh0 * G + i) * D + 32 * c;
            _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), s)));
            _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), s)));
        }
}
#endif

/* q, out [batch, heads, D] bfloat16; the pools [num_blocks, block_size, kv_heads, D] bfloat16; tables [batch,
 * max_blocks], first, last [batch] as paged_decode_attention's. Returns 0; 1 when the scratch cannot be allocated; 2
 * for shapes it does not take (D % 32, D > 256, block_size % 16, more than 16 query heads a K/V head) or where it is
 * not built or granted. The caller's tile configuration is put back after. */
int paged_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool, uint16_t *out,
                                    const int64_t *tables, const int64_t *first, const int64_t *last, int batch,
                                    int heads, int kv_heads, int D, int block_size, int max_blocks, float scale,
                                    int threads) {
#if defined(ATTENTION_AMX)
    int G = kv_heads > 0 ? heads / kv_heads : 0;
    if (D % 32 || D > 256 || block_size % 16 || G < 1 || G > GROUP_ROWS || heads % kv_heads || !amx_granted())
        return 2;
    int g = GROUP_ROWS / G < kv_heads ? GROUP_ROWS / G : kv_heads, groups = (kv_heads + g - 1) / g, failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        size_t qt = (size_t)g * (D / 32) * 1024, vt = (size_t)(D / 16) * 1024, pt = 1024, ptiles = (size_t)g * 1024;
        char *mem = aligned_alloc(64, qt + vt + pt + ptiles + KB * 64 + 64 * (size_t)D);
        decode_scratch w = {(uint32_t *)mem, (uint32_t *)(mem + qt), (uint32_t *)(mem + qt + vt),
                            (uint32_t *)(mem + qt + vt + pt), (float *)(mem + qt + vt + pt + ptiles),
                            (float *)(mem + qt + vt + pt + ptiles + KB * 64)};
        if (!mem) {
            #pragma omp atomic write
            failed = 1;
        }
        tile_config saved;
        if (mem) amx_configure(&saved);
        #pragma omp for schedule(dynamic)
        for (int task = 0; task < batch * groups; task++) {
            int b = task / groups, kvh0 = (task % groups) * g, gg = kv_heads - kvh0 < g ? kv_heads - kvh0 : g;
            if (!mem) continue;
            decode_group(q + (int64_t)b * heads * D, k_pool, v_pool, out + (int64_t)b * heads * D,
                         tables + (int64_t)b * max_blocks, first[b], last[b], kvh0, gg, G, kv_heads, D, block_size,
                         scale, &w);
        }
        if (mem) amx_restore(&saved);
        free(mem);
    }
    return failed;
#else
    (void)q, (void)k_pool, (void)v_pool, (void)out, (void)tables, (void)first, (void)last, (void)batch, (void)heads;
    (void)kv_heads, (void)D, (void)block_size, (void)max_blocks, (void)scale, (void)threads;
    return 2;
#endif
}


/* q [H, T, D], k and v [KV, S, D], out [H, T, D], bfloat16, at the given element strides (a head's, a row's; a
 * row's D elements contiguous). Returns 0; 1 when the packed K and V cannot be allocated; 2 for shapes it does
 * not take (D % 32, D > 256, T > S, H % KV) or where it is not built or granted (bf16_amx_ready() == 0). The
 * caller's tile configuration is put back after. */
int causal_attention_bf16_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int H, int KV,
                              int T, int S, int D, int64_t q_head, int64_t q_row, int64_t k_head, int64_t k_row,
                              int64_t v_head, int64_t v_row, int64_t o_head, int64_t o_row, float scale, int threads) {
#if defined(ATTENTION_AMX)
    if (D % 32 || D > 256 || T < 1 || T > S || KV < 1 || H % KV || !amx_granted()) return 2;
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
        tile_config saved;
        amx_configure(&saved);
        #pragma omp for schedule(dynamic)
        for (int task = 0; task < H * blocks; task++) {  /* the last blocks first: they see the most keys */
            int h = task % H, t0 = 16 * (blocks - 1 - task / H);
            query_block(q, q_head, q_row, kp + (h / G) * head_size, vt + (h / G) * head_size, out, o_head, o_row, h,
                        t0, T, S, D, scale);
        }
        amx_restore(&saved);
    }
    free(kp);
    free(vt);
    return 0;
#else
    (void)q, (void)k, (void)v, (void)out, (void)H, (void)KV, (void)T, (void)S, (void)D, (void)q_head, (void)q_row;
    (void)k_head, (void)k_row, (void)v_head, (void)v_row, (void)o_head, (void)o_row, (void)scale, (void)threads;
    return 2;
#endif
}
