/* Products with int8 and int4 matrices, read as their codes (minillm/quantize.py's formats):
 *
 *   int8  ŵ[o, i] = q[o, i] · scale[o]                 q int8 [out, in], scale float32 [out]
 *   int4  ŵ[o, i] = (q[o, i] - zero[o, g]) · scale[o, g],  g = i / group
 *                                                      packed uint8 [out, in/2] (byte j = q[2j] | q[2j+1] << 4),
 *                                                      scale float32, zero uint8 [out, in/group]
 *   y[r, o] = Σ_i x[r, i] · ŵ[o, i]                    x float32 [rows, in], y float32 [rows, out]
 *
 * by the number of rows (minillm/fast/products.py chooses):
 *
 *   1-3 rows       int8_matvec, int4_matvec        each code widened to float once a row (one row with
 *                                                  AVX512-VNNI: x's digits by the codes, quantized_vnni.c)
 *   4-128 rows     int8_matmul, int4_matmul        a tile of ŵ dequantised once for every row
 *                  quantized_panel_matmul          (a server) the panel micro-kernel on a packed copy
 *   more (prefill) int8_dequantize, int4_dequantize  the whole float matrix, for one float product
 *
 * Each computes quantized_matmul_reference's sums in another order (dequantize: its ŵ):
 * tests/test_quantize.py and tests/fast/test_quantized_batches.py check them, native and portable builds,
 * against QuantizedLinear.forward_reference (dequantise, then F.linear); tests/fast/test_matvec_kernels.py
 * checks this reference against it too.
 */
#include "quantized_digits.h"

/* The scalar reference. ŵ[o, i]: int8 when zero is NULL, else int4. */
static float dequantized(const void *codes, const float *scale, const uint8_t *zero, int64_t o, int i, int in,
                         int group) {
    if (zero == NULL) return (float)((const int8_t *)codes)[o * in + i] * scale[o];
    int64_t g = o * (in / group) + i / group;
    int q = (((const uint8_t *)codes)[o * (in / 2) + i / 2] >> (4 * (i % 2))) & 15;
    return (float)(q - zero[g]) * scale[g];
}

void quantized_matmul_reference(const float *x, const void *codes, const float *scale, const uint8_t *zero,
                                float *y, int rows, int out, int in, int group) {
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < out; o++) {
            float sum = 0.0f;
            for (int i = 0; i < in; i++)
                sum += x[(int64_t)r * in + i] * dequantized(codes, scale, zero, o, i, in, group);
            y[(int64_t)r * out + o] = sum;
        }
}

/* -- int8_matvec, int4_matvec: 1-3 rows, each code widened once a row --------------------------------
 *
 *   int8  y[r, o] = scale[o] · Σ_i x[r, i] · q[o, i]
 *   int4  y[r, o] = Σ_g scale[o, g] · Σ_{i in g} x[r, i] · (q[o, i] - zero[o, g])
 *
 * q - zero is formed in integers, before the product. Taking zero · Σ x out of each group's float sum instead (as
 * GPTQ's kernels do) cancels where q is near zero: every weight 0 in one group of 131,072 gave 187.8 (a new user's
 * trial).
 *
 * Each output o is one thread's work (OpenMP, `threads` of them); its row of codes is read once for
 * all rows of x. */

/* Σ_i x[i]·q[i]. AVX2: 8 codes widened to 8 floats, times 8 of x, into one of four vector sums,
 * so that four multiply-adds are in flight (one running sum waits out each one's latency: the
 * compiler's vectorised loop took SmolLM2's 49152x576 head 2.3 ms against 1.3, developers' EPYC). */
static float int8_dot(const int8_t *q, const float *x, int n) {
    float sum = 0.0f;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i + 8 * k)));
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * k), _mm256_cvtepi32_ps(codes), acc[k]);
        }
    sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
    for (; i < n; i++) sum += x[i] * (float)q[i];
    return sum;
}

/* Returns 0, or 1 when one row's digits cannot be allocated. One row runs on the vector units where the build has
 * AVX512-VNNI (quantized_vnni.c). */
int int8_matvec(const float *x, const int8_t *q, const float *scale, float *y, int rows, int out, int in,
                int threads) {
    int status = rows == 1 ? int8_vnni_matvec(x, q, scale, y, out, in, threads) : 2;
    if (status != 2) return status;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int r = 0; r < rows; r++)
            y[(int64_t)r * out + o] = scale[o] * int8_dot(q + (int64_t)o * in, x + (int64_t)r * in, in);
    return 0;
}

/* One output of int4: Σ_g scale[g] · Σ_j (xe[j]·(low(b[j]) - zero[g]) + xo[j]·(high(b[j]) - zero[g])),
 * j over the group's bytes, with xe, xo the even and odd elements of x (the low and high nibbles'
 * partners). AVX2: 8 bytes widened to 8 int32 lanes, the two nibbles split by a mask and a shift, less the
 * zero point, each multiplied into its own vector sum (two multiply-adds in flight), the lanes summed once per
 * output. The compiler's vectorisation of the portable loop took SmolLM2's 49152x576 head 10.3 ms
 * against 1.4 (developers' AMD EPYC). */
static float int4_dot(const uint8_t *b, const float *scale, const uint8_t *zero, const float *xe,
                      const float *xo, int groups, int half_group) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256 dot_low = _mm256_setzero_ps(), dot_high = _mm256_setzero_ps();
        __m256i z = _mm256_set1_epi32(zero[g]);
        for (int j = g * half_group; j < (g + 1) * half_group; j += 8) {
            __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + j)));
            __m256 low = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), z));
            __m256 high = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), z));
            dot_low = _mm256_fmadd_ps(_mm256_loadu_ps(xe + j), low, dot_low);
            dot_high = _mm256_fmadd_ps(_mm256_loadu_ps(xo + j), high, dot_high);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(scale[g]), _mm256_add_ps(dot_low, dot_high), acc);
    }
    float sum = hsum(acc);
#else
    float sum = 0.0f;
    for (int g = 0; g < groups; g++) {
        float dot = 0.0f;
        for (int j = g * half_group; j < (g + 1) * half_group; j++)
            dot += xe[j] * (float)((b[j] & 15) - zero[g]) + xo[j] * (float)((b[j] >> 4) - zero[g]);
        sum += scale[g] * dot;
    }
#endif
    return sum;
}

/* group must be a multiple of 16 (8 bytes a step of int4_dot) and divide in. Returns 0, or 1 when
 * the scratch copy of x (one row's digits) cannot be allocated. One row runs on the vector units as int8's does. */
int int4_matvec(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero,
                float *y, int rows, int out, int in, int group, int threads) {
    int status = rows == 1 ? int4_vnni_matvec(x, packed, scale, zero, y, out, in, group, threads) : 2;
    if (status != 2) return status;
    int half = in / 2, groups = in / group;
    /* x split once into even and odd elements */
    float *xe = (float *)malloc(sizeof(float) * (size_t)rows * in);  /* (a cast C++ needs: ops.cpp) */
    if (xe == NULL) return 1;
    float *xo = xe + (size_t)rows * half;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < half; j++) {
            xe[r * half + j] = x[(int64_t)r * in + 2 * j];
            xo[r * half + j] = x[(int64_t)r * in + 2 * j + 1];
        }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int r = 0; r < rows; r++)
            y[(int64_t)r * out + o] = int4_dot(packed + (int64_t)o * half, scale + (int64_t)o * groups,
                                               zero + (int64_t)o * groups, xe + r * half, xo + r * half, groups,
                                               group / 2);
    free(xe);
    return 0;
}

/* -- int8_dequantize, int4_dequantize: the float matrix prefill multiplies ----------------------------
 * (many rows: one float product beats re-reading codes row by row). w: float32 [out, in]. Return 0. */

int int8_dequantize(const int8_t *q, const float *scale, float *w, int out, int in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int i = 0; i < in; i++) w[(int64_t)o * in + i] = scale[o] * (float)q[(int64_t)o * in + i];
    return 0;
}

int int4_dequantize(const uint8_t *packed, const float *scale, const uint8_t *zero, float *w, int out, int in,
                    int group, int threads) {
    int half = in / 2, groups = in / group;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int g = 0; g < groups; g++) {
            float s = scale[(int64_t)o * groups + g], offset = -s * zero[(int64_t)o * groups + g];
            const uint8_t *b = packed + (int64_t)o * half + g * (group / 2);
            float *wg = w + (int64_t)o * in + g * group;
            for (int j = 0; j < group / 2; j++) {
                wg[2 * j] = s * (float)(b[j] & 15) + offset;
                wg[2 * j + 1] = s * (float)(b[j] >> 4) + offset;
            }
        }
    return 0;
}

/* -- int8_matmul, int4_matmul: a batch of rows (a serving step's decodes), a tile at a time ------------
 *
 * int8_matvec and int4_matvec widen every code to float once per row of x: past a few rows that
 * widening, not reading the codes, is the time, and unpacking the whole float matrix for one float
 * product writes and reads 4 bytes a weight (float32's own traffic, plus the unpacking). Here each
 * thread takes a tile of the matrix's output rows, dequantises it once into a float buffer of
 * TILE_BYTES (it stays in L1/L2), and multiplies it with every row of x:
 *
 *               in                                 tile ŵ: tile_rows x in, float
 *        +-------------+                  +-------------+
 *   x    | rows x in   |   y[:, tile] =   x  @  ŵᵀ     in blocks of BLOCK_X rows of x by BLOCK_W
 *        +-------------+                  +-------------+    rows of ŵ: BLOCK_X·BLOCK_W vector sums
 *                                                            in registers, each row of ŵ loaded once
 *                                                            for BLOCK_X rows, each row of x once for
 *                                                            BLOCK_W rows of ŵ
 *
 * ŵ is quantize.py's own dequantised value (q · scale; (q - zero) · scale), so y differs from the
 * reference F.linear(x, ŵ) only in the order of the float sums. For int4 the tile keeps each 16
 * weights as the 8 even ones (low nibbles) then the 8 odd ones (high nibbles), and the copy of x is
 * permuted the same way: a dot product does not depend on the order of its terms. While a tile is
 * multiplied, the next tile's codes are prefetched, so reading them overlaps the arithmetic.
 *
 * AVX-512 has 32 vector registers, room for a 4 x 6 block, AVX2 16, room for 4 x 3. */
#if defined(__AVX512F__)
#define BLOCK_W 6
#else
#define BLOCK_W 3
#endif
#define BLOCK_X 4
#define TILE_BYTES 32768  /* one tile of floats: L1 on recent x86 cores; 16, 64 and 96 KiB measured no faster */

/* y[r·y_stride + o] = Σ_i x[r·n + i] · w[o·n + i] for R <= BLOCK_X rows of x and the first `valid`
 * of BLOCK_W rows of w (n a multiple of VEC; inlined with R a constant, its loops unroll). */
static inline __attribute__((always_inline)) void block_dots(const float *x, const float *w, int n, int R,
                                                             float *y, int64_t y_stride, int valid) {
    vecf acc[BLOCK_X][BLOCK_W];
    memset(acc, 0, sizeof acc);
    for (int i = 0; i < n; i += VEC) {
        vecf wv[BLOCK_W];
        for (int o = 0; o < BLOCK_W; o++) wv[o] = load_vec(w + (int64_t)o * n + i);
        for (int r = 0; r < R; r++) {
            vecf xv = load_vec(x + (int64_t)r * n + i);
            for (int o = 0; o < BLOCK_W; o++) acc[r][o] += xv * wv[o];
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < valid; o++) y[r * y_stride + o] = vec_sum(acc[r][o]);
}

/* The codes of one matrix: int8 (q8, scale [out]) or int4 (q4, scale and zero [out, in/group]). */
typedef struct {
    const int8_t *q8;
    const uint8_t *q4;
    const float *scale;
    const uint8_t *zero;
    int group;
} Codes;

/* tile[t, :] = ŵ[first + t, :] for t < n, zeros up to `padded` columns and to a whole block of rows. */
static void dequantize_tile(const Codes *c, int first, int n, int in, int padded, float *tile) {
    for (int t = 0; t < n; t++) {
        int64_t o = first + t;
        float *row = tile + (int64_t)t * padded;
        if (c->q8) {
            const int8_t *q = c->q8 + o * in;
            float s = c->scale[o];
            for (int i = 0; i < in; i++) row[i] = (float)q[i] * s;  /* (the compiler vectorises this one) */
        } else {
            int groups = in / c->group;
            const uint8_t *b = c->q4 + o * (in / 2);
            for (int i = 0; i < in; i += 16) {  /* 8 bytes: the even weights, then the odd ones */
                float s = c->scale[o * groups + i / c->group], z = (float)c->zero[o * groups + i / c->group];
#if defined(__AVX2__) && defined(__FMA__)
                __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + i / 2)));
                __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
                __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
                _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_sub_ps(low, _mm256_set1_ps(z)), _mm256_set1_ps(s)));
                _mm256_storeu_ps(row + i + 8, _mm256_mul_ps(_mm256_sub_ps(high, _mm256_set1_ps(z)), _mm256_set1_ps(s)));
#else
                for (int l = 0; l < 8; l++) {
                    row[i + l] = ((float)(b[i / 2 + l] & 15) - z) * s;
                    row[i + 8 + l] = ((float)(b[i / 2 + l] >> 4) - z) * s;
                }
#endif
            }
        }
        memset(row + in, 0, sizeof(float) * (padded - in));
    }
    int whole = (n + BLOCK_W - 1) / BLOCK_W * BLOCK_W;
    memset(tile + (int64_t)n * padded, 0, sizeof(float) * (whole - n) * padded);
}

/* y [rows, out] = x [rows, in] @ ŵᵀ, a tile of ŵ's rows at a time (threads split the tiles). Returns
 * 0, or 1 when a scratch buffer cannot be allocated. */
static int tiled_product(const float *x, const Codes *c, float *y, int rows, int out, int in, int threads) {
    if (rows == 0) return 0;  /* (no rows: nothing to write, and no blocks to share the prefetching between) */
    int padded = (in + VEC - 1) / VEC * VEC, failed = 0;
    int tile_rows = TILE_BYTES / (4 * padded) / BLOCK_W * BLOCK_W;
    tile_rows = tile_rows < BLOCK_W ? BLOCK_W : tile_rows;
    int n_tiles = (out + tile_rows - 1) / tile_rows;
    int64_t code_bytes = c->q8 ? in : in / 2;  /* a row of codes */
    const char *codes = c->q8 ? (const char *)c->q8 : (const char *)c->q4;
    float *xp = (float *)calloc((size_t)rows * padded, sizeof(float));  /* x, padded (int4: permuted) */
    if (xp == NULL) return 1;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * in;
        float *pr = xp + (int64_t)r * padded;
        if (c->q8)
            memcpy(pr, xr, sizeof(float) * in);
        else
            for (int i = 0; i < in; i += 16)
                for (int l = 0; l < 8; l++) {
                    pr[i + l] = xr[i + 2 * l];
                    pr[i + 8 + l] = xr[i + 2 * l + 1];
                }
    }
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *tile = (float *)malloc(sizeof(float) * tile_rows * padded);  /* one a thread */
        failed = tile == NULL;
        #pragma omp for schedule(static)
        for (int t = 0; t < n_tiles; t++) {
            if (tile == NULL) continue;
            int first = t * tile_rows, n = out - first < tile_rows ? out - first : tile_rows;
            dequantize_tile(c, first, n, in, padded, tile);
            int64_t next = (int64_t)(first + n) * code_bytes;  /* the next tile's codes, prefetched a few */
            int64_t next_end = (int64_t)(out - first - n < tile_rows ? out : first + n + tile_rows) * code_bytes;
            int blocks = (rows + BLOCK_X - 1) / BLOCK_X * ((n + BLOCK_W - 1) / BLOCK_W);  /* lines a block */
            int64_t lines_per_block = ((next_end - next) / 64 + blocks) / blocks;
            for (int r = 0; r < rows; r += BLOCK_X) {
                const float *xr = xp + (int64_t)r * padded;
                for (int o = 0; o < n; o += BLOCK_W) {
                    int valid = n - o < BLOCK_W ? n - o : BLOCK_W;
                    const float *w = tile + (int64_t)o * padded;
                    float *yr = y + (int64_t)r * out + first + o;
                    switch (rows - r < BLOCK_X ? rows - r : BLOCK_X) {  /* R a constant in each call */
                        case 4: block_dots(xr, w, padded, 4, yr, out, valid); break;
                        case 3: block_dots(xr, w, padded, 3, yr, out, valid); break;
                        case 2: block_dots(xr, w, padded, 2, yr, out, valid); break;
                        default: block_dots(xr, w, padded, 1, yr, out, valid);
                    }
                    for (int64_t l = 0; l < lines_per_block && next < next_end; l++, next += 64)
                        __builtin_prefetch(codes + next);
                }
            }
        }
        free(tile);
    }
    free(xp);
    return failed;
}

/* Return 0, or 1 when out of memory; int4: group a multiple of 16 dividing in. */
int int8_matmul(const float *x, const int8_t *q, const float *scale, float *y, int rows, int out, int in,
                int threads) {
    Codes c = {q, NULL, scale, NULL, 0};
    return tiled_product(x, &c, y, rows, out, in, threads);
}

int int4_matmul(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero, float *y,
                int rows, int out, int in, int group, int threads) {
    Codes c = {NULL, packed, scale, zero, group};
    return tiled_product(x, &c, y, rows, out, in, threads);
}

/* -- quantized_panel_matmul: a server's batch of rows on the panel micro-kernel ------------------------
 *
 * products.c's micro-kernel with each weight dequantised in registers as it is loaded. The codes are
 * copied once into panel order, so that one step of i loads a panel's PANEL codes as whole vectors:
 *
 *   int8  codes[p, i, l] = q[o, i]                                (o = p·PANEL + l; 0 past `out`)
 *   int4  codes[p, i, b] = q[o, i] | q[o + PANEL/2, i] << 4       (b = l < PANEL/2)
 *   both  scales[p, g, l] = scale[o, g],  offsets[p, g, l] = -zero[o, g] · scale[o, g]   (int8: one
 *         group, no zero)
 *
 *   ŵ[o, i] = q[o, i] · scale + offset   (quantize.py's q · scale and (q - zero) · scale)
 *
 * One step reads PANEL bytes (int8) or PANEL/2 (int4) where float32 reads 4 · PANEL, and spends one
 * conversion and one multiply-add a vector on them before the 2 · R multiply-adds of the rows. */
#define HALF (PANEL / 2)
typedef int8_t vec_i8 __attribute__((vector_size(VEC)));
typedef uint8_t vec_u8 __attribute__((vector_size(VEC)));

void int8_pack_panels(const int8_t *q, const float *scale, int8_t *codes, float *scales, float *offsets, int out,
                      int in, int threads) {
    int panels = (out + PANEL - 1) / PANEL;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < panels; p++)
        for (int l = 0; l < PANEL; l++) {
            int64_t o = (int64_t)p * PANEL + l;
            scales[o] = o < out ? scale[o] : 0.0f;
            offsets[o] = 0.0f;
            for (int i = 0; i < in; i++) codes[((int64_t)p * in + i) * PANEL + l] = o < out ? q[o * in + i] : 0;
        }
}

/* packed: the row-major int4 codes [out, in/2] (byte j = q[2j] | q[2j+1] << 4); group divides in */
void int4_pack_panels(const uint8_t *packed, const float *scale, const uint8_t *zero, uint8_t *codes,
                      float *scales, float *offsets, int out, int in, int group, int threads) {
    int panels = (out + PANEL - 1) / PANEL, groups = in / group;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < panels; p++) {
        for (int l = 0; l < PANEL; l++)
            for (int g = 0; g < groups; g++) {
                int64_t o = (int64_t)p * PANEL + l, at = ((int64_t)p * groups + g) * PANEL + l;
                scales[at] = o < out ? scale[o * groups + g] : 0.0f;
                offsets[at] = o < out ? -(float)zero[o * groups + g] * scale[o * groups + g] : 0.0f;
            }
        for (int i = 0; i < in; i++)
            for (int b = 0; b < HALF; b++) {
                int64_t lo = (int64_t)p * PANEL + b, hi = lo + HALF;
                int q_lo = lo < out ? (packed[lo * (in / 2) + i / 2] >> (4 * (i % 2))) & 15 : 0;
                int q_hi = hi < out ? (packed[hi * (in / 2) + i / 2] >> (4 * (i % 2))) & 15 : 0;
                codes[((int64_t)p * in + i) * HALF + b] = (uint8_t)(q_lo | q_hi << 4);
            }
    }
}

/* y[r·out + l] = Σ_i x[r·in + i] · ŵ(panel p)[i, l], l < valid, for R rows (inlined with R and int4
 * constants); prefetches 128 bytes of `next` every `every` steps */
static inline __attribute__((always_inline)) void quantized_panel_rows(
        const float *x, const char *codes, const float *scales, const float *offsets, int in, int group, int int4,
        int R, float *y, int out, int valid, const char *next, int every) {
    vecf acc[PANEL_ROWS][2];
    memset(acc, 0, sizeof acc);
    vecf s0 = {0}, s1 = {0}, z0 = {0}, z1 = {0};
    int wait = every, left = 0;  /* (a counter for the groups too: no division a step) */
    for (int i = 0; i < in; i++) {
        if (left-- == 0) {  /* a group's scales and offsets */
            s0 = load_vec(scales), s1 = load_vec(scales + VEC), z0 = load_vec(offsets), z1 = load_vec(offsets + VEC);
            scales += PANEL, offsets += PANEL, left = group - 1;
        }
        vecf w0, w1;
#if defined(__AVX512F__)  /* (GCC's __builtin_convertvector of bytes to floats goes lane by lane) */
        if (int4) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + (int64_t)i * HALF)));
            w0 = (vecf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
            w1 = (vecf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
        } else {
            w0 = (vecf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + (int64_t)i * PANEL))));
            w1 = (vecf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + (int64_t)i * PANEL + VEC))));
        }
#elif defined(__AVX2__)
        if (int4) {
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + (int64_t)i * HALF)));
            w0 = (vecf)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
            w1 = (vecf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
        } else {
            w0 = (vecf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + (int64_t)i * PANEL))));
            w1 = (vecf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + (int64_t)i * PANEL + VEC))));
        }
#else
        if (int4) {
            vec_u8 b;  /* (VEC bytes: with PANEL = 2 · VEC, exactly one step's HALF) */
            memcpy(&b, codes + (int64_t)i * HALF, sizeof b);
            w0 = __builtin_convertvector(b & 15, vecf);
            w1 = __builtin_convertvector(b >> 4, vecf);
        } else {
            vec_i8 c0, c1;
            memcpy(&c0, codes + (int64_t)i * PANEL, sizeof c0);
            memcpy(&c1, codes + (int64_t)i * PANEL + VEC, sizeof c1);
            w0 = __builtin_convertvector(c0, vecf);
            w1 = __builtin_convertvector(c1, vecf);
        }
#endif
        w0 = w0 * s0 + z0;
        w1 = w1 * s1 + z1;
        for (int r = 0; r < R; r++) {
            float xr = x[(int64_t)r * in + i];
            acc[r][0] += w0 * xr;
            acc[r][1] += w1 * xr;
        }
        prefetch_every(&wait, every, &next, 128);
    }
    store_rows(acc, R, y, out, valid);
}

/* 1 where quantized_panel_matmul converts codes with vector instructions (AVX2, AVX-512); elsewhere the
 * compiler converts them lane by lane, and the tiled kernels above are faster (measured: 2.2x at 8 rows). */
int quantized_panels_vectorised(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* y [rows, out] = x [rows, in] @ ŵᵀ from int8_pack_panels' (int4 = 0, group = in) or int4_pack_panels'
 * copy (int4 = 1). */
void quantized_panel_matmul(const float *x, const char *codes, const float *scales, const float *offsets, float *y,
                            int rows, int out, int in, int group, int int4, int threads) {
    int panels = (out + PANEL - 1) / PANEL, blocks = (rows + PANEL_ROWS - 1) / PANEL_ROWS, groups = in / group;
    int64_t code_bytes = (int64_t)in * (int4 ? HALF : PANEL);  /* a panel's codes */
    int every = (int)(((int64_t)in * blocks * 128 + code_bytes - 1) / code_bytes);  /* the next panel's, spread */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < panels; p++) {
        const char *c = codes + p * code_bytes, *next = codes + (p + 1 < panels ? p + 1 : p) * code_bytes;
        const float *sp = scales + (int64_t)p * groups * PANEL, *op = offsets + (int64_t)p * groups * PANEL;
        int valid = out - p * PANEL < PANEL ? out - p * PANEL : PANEL, done = 0;
        for (int b = 0; b < blocks; b++) {
            int R = (rows - done) / (blocks - b);
            const float *xb = x + (int64_t)done * in;
            float *yb = y + (int64_t)done * out + (int64_t)p * PANEL;
            const char *share = next + code_bytes * b / blocks;
            switch (R + (int4 ? 100 : 0)) {
#define ROWS(n) case n: quantized_panel_rows(xb, c, sp, op, in, group, 0, n, yb, out, valid, share, every); break; \
                case 100 + n: quantized_panel_rows(xb, c, sp, op, in, group, 1, n, yb, out, valid, share, every); break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if PANEL_ROWS > 6
                ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
#undef ROWS
            }
            done += R;
        }
    }
}
