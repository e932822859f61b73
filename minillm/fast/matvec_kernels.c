/* Decode's products: y = x @ wᵀ for a few rows of x, reading each weight once; quantised matrices
 * are read as their packed codes. And decode's attention (at the end of this file).
 *
 * Built at first use by minillm/fast/kernels.py (cc -O3 -march=native -fopenmp, under a second)
 * and called through ctypes. The quantised arithmetic is minillm/quantize.py's reference path,
 * reordered:
 *
 *   f32   y[r, o] = Σ_i x[r, i] · w[o, i]
 *   int8  y[r, o] = scale[o] · Σ_i x[r, i] · q[o, i]
 *   int4  y[r, o] = Σ_g scale[o, g] · (Σ_{i in g} x[r, i] · q[o, i]  -  zero[o, g] · Σ_{i in g} x[r, i])
 *
 * (the zero point comes out of each group's sum, as in GPTQ's kernels). Each output o is one
 * thread's work (OpenMP, `threads` of them); its row of codes is read once for all rows of x.
 *
 * Layouts (row-major, as QuantizedLinear stores them):
 *   x      float32 [rows, in]           y      float32 [rows, out]
 *   w      float32 [out, in]                                                            (f32)
 *   q      int8    [out, in]            scale  float32 [out]                        (int8)
 *   packed uint8   [out, in/2]          scale  float32 [out, in/group]
 *          byte j = q[2j] | q[2j+1] << 4                    zero   uint8   [out, in/group]   (int4)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static float hsum(__m256 v) {  /* the sum of 8 lanes: halves added, then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* Σ_i x[i]·w[i] in float32. AVX2: four vector sums of 8 lanes, so that four multiply-adds are in
 * flight; the loop reads w as fast as the memory delivers it (int8_dot below says why four). */
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

static void prefetch_bytes(const void *p, int64_t n) {  /* each 64-byte line of p[0:n], into the caches */
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch((const char *)p + b);
}

/* The float32 product of a decode step or a verify pass: MKL's product of a few rows runs on one
 * core, which cannot stream memory as fast as all of them (minillm.model.linear says more). Each thread
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

void int8_matvec(const float *x, const int8_t *q, const float *scale, float *y,
                 int rows, int out, int in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int r = 0; r < rows; r++)
            y[(int64_t)r * out + o] = scale[o] * int8_dot(q + (int64_t)o * in, x + (int64_t)r * in, in);
}

/* One output of int4: Σ_g scale[g] · (Σ_j xe[j]·low(b[j]) + xo[j]·high(b[j])  -  zero[g] · xsum[g]),
 * j over the group's bytes, with xe, xo the even and odd elements of x (the low and high nibbles'
 * partners). AVX2: 8 bytes widened to 8 int32 lanes, the two nibbles split by a mask and a shift,
 * each multiplied into its own vector sum (two multiply-adds in flight), the lanes summed once per
 * output. The compiler's vectorisation of the portable loop took SmolLM2's 49152x576 head 10.3 ms
 * against 1.4 (developers' AMD EPYC). */
static float int4_dot(const uint8_t *b, const float *scale, const uint8_t *zero, const float *xe,
                      const float *xo, const float *xsum, int groups, int half_group) {
    float zero_term = 0.0f;
    for (int g = 0; g < groups; g++) zero_term += scale[g] * zero[g] * xsum[g];
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256 dot_low = _mm256_setzero_ps(), dot_high = _mm256_setzero_ps();
        for (int j = g * half_group; j < (g + 1) * half_group; j += 8) {
            __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + j)));
            __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
            __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
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
            dot += xe[j] * (float)(b[j] & 15) + xo[j] * (float)(b[j] >> 4);
        sum += scale[g] * dot;
    }
#endif
    return sum - zero_term;
}

/* group must be a multiple of 16 (8 bytes a step of int4_dot) and divide in. Returns 0, or 1 when
 * the scratch copy of x cannot be allocated. */
int int4_matvec(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero,
                 float *y, int rows, int out, int in, int group, int threads) {
    int half = in / 2, groups = in / group;
    /* x split once into even and odd elements, and its sum over each group */
    float *xe = (float *)malloc(sizeof(float) * (size_t)rows * (in + groups));  /* (a cast C++ needs: matvec_ops.cpp) */
    if (xe == NULL) return 1;
    float *xo = xe + (size_t)rows * half, *xsum = xo + (size_t)rows * half;
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < half; j++) {
            xe[r * half + j] = x[(int64_t)r * in + 2 * j];
            xo[r * half + j] = x[(int64_t)r * in + 2 * j + 1];
        }
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int i = g * group; i < (g + 1) * group; i++) s += x[(int64_t)r * in + i];
            xsum[r * groups + g] = s;
        }
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int r = 0; r < rows; r++)
            y[(int64_t)r * out + o] = int4_dot(packed + (int64_t)o * half, scale + (int64_t)o * groups,
                                               zero + (int64_t)o * groups, xe + r * half, xo + r * half,
                                               xsum + r * groups, groups, group / 2);
    free(xe);
    return 0;
}

/* ŵ[o, i] = (q[o, i] - zero[o, g]) · scale[o, g] for every weight: the float matrix prefill
 * multiplies (many rows: a float product beats re-reading codes row by row). w: float32 [out, in]. */
void int4_dequantize(const uint8_t *packed, const float *scale, const uint8_t *zero, float *w,
                     int out, int in, int group, int threads) {
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
}

/* ŵ[o, i] = q[o, i] · scale[o]: int8's float matrix for prefill. w: float32 [out, in]. */
void int8_dequantize(const int8_t *q, const float *scale, float *w, int out, int in, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < out; o++)
        for (int i = 0; i < in; i++) w[(int64_t)o * in + i] = scale[o] * (float)q[(int64_t)o * in + i];
}

/* -- A batch of rows (a serving step's decodes): the codes dequantised a tile at a time ------------
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
 * The vector type is the compiler's (GCC/Clang vector extensions): 16 floats with AVX-512, 8 with
 * AVX, 4 otherwise; AVX-512 has 32 registers, room for a 4 x 6 block, AVX2 16, room for 4 x 3. */
#if defined(__AVX512F__)
#define VEC 16
#define BLOCK_W 6
#elif defined(__AVX__)
#define VEC 8
#define BLOCK_W 3
#else
#define VEC 4
#define BLOCK_W 3
#endif
#define BLOCK_X 4
#define TILE_BYTES 32768  /* one tile of floats: L1 on recent x86 cores; 16, 64 and 96 KiB measured no faster */
typedef float vecf __attribute__((vector_size(VEC * 4)));

static inline vecf load_vec(const float *p) {
    vecf v;
    memcpy(&v, p, sizeof v);  /* an unaligned load */
    return v;
}

static inline float vec_sum(vecf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__) && defined(__FMA__)
    return hsum((__m256)v);
#else
    float s = 0.0f;
    for (int l = 0; l < VEC; l++) s += v[l];
    return s;
#endif
}

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

/* y [rows, out] = x [rows, in] @ ŵᵀ, ŵ = q · scale[o]. Returns 0, or 1 when out of memory. */
int int8_matmul(const float *x, const int8_t *q, const float *scale, float *y, int rows, int out, int in,
                int threads) {
    Codes c = {q, NULL, scale, NULL, 0};
    return tiled_product(x, &c, y, rows, out, in, threads);
}

/* y [rows, out] = x [rows, in] @ ŵᵀ, ŵ = (q - zero) · scale per group; group a multiple of 16 dividing
 * in. Returns 0, or 1 when out of memory. */
int int4_matmul(const float *x, const uint8_t *packed, const float *scale, const uint8_t *zero, float *y,
                int rows, int out, int in, int group, int threads) {
    Codes c = {NULL, packed, scale, zero, group};
    return tiled_product(x, &c, y, rows, out, in, threads);
}

/* -- A batch of rows in float32 (a serving step's decodes, a short prefill chunk): panels -------
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
 * Xeon, 2026-12-03, ms for all, panels / oneDNN's packed product / the C loop above):
 *
 *   rows         1     8    16    32    40   128   256   512
 *   panels     14.9  20.0  22.1  26.9  29.6  72.9  143   285
 *   oneDNN     21.2  26.0  31.0  38.9  43.1  91.4  151   278    (F.linear at 512: 279)
 *   C loop     17.9  24.4  39.3  76.2
 *
 * The sum over i runs in order, one term at a time per output (not as vector partial sums): float
 * rounding grows like √in·ε, as in a plain loop. */
#if defined(__AVX512F__)
#define PANEL_ROWS 12
#else
#define PANEL_ROWS 6
#endif
#define PANEL (2 * VEC)

static inline void store_vec(float *p, vecf v) { memcpy(p, &v, sizeof v); }

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

/* One step of a micro-kernel's spread prefetch: every `every` steps (0: never), the 128 bytes at *next,
 * then *next moves on by `step` bytes. */
static inline __attribute__((always_inline)) void prefetch_every(int *wait, int every, const char **next,
                                                                 int64_t step) {
    if (every && --*wait == 0) {  /* (a counter: a division a step cost more than the prefetch saves) */
        *wait = every;
        __builtin_prefetch(*next, 0, 2);
        __builtin_prefetch(*next + 64, 0, 2);
        *next += step;
    }
}

/* y[r·y_stride + l] = acc[r][l / VEC][l % VEC] for r < R, l < valid */
static inline __attribute__((always_inline)) void store_rows(vecf acc[PANEL_ROWS][2], int R, float *y,
                                                             int64_t y_stride, int valid) {
    for (int r = 0; r < R; r++) {
        float *yr = y + (int64_t)r * y_stride, last[PANEL];
        store_vec(valid == PANEL ? yr : last, acc[r][0]);
        store_vec(valid == PANEL ? yr + VEC : last + VEC, acc[r][1]);
        if (valid < PANEL) memcpy(yr, last, sizeof(float) * valid);
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
static void panel_block(const float *x, int64_t x_stride, const float *panel, int64_t panel_stride, int in, int R,
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
            panel_block(x + (int64_t)done * in, in, panel, PANEL, in, R, y + (int64_t)done * out + (int64_t)p * PANEL,
                        out, valid, 0, share, blocks);
            done += R;
        }
    }
}

/* Decode attention: each sequence's one new query against its first n_keys cached keys,
 *
 *   out[b, h] = Σ_j softmax_j(scale · q[b, h]·k[b, h/G, j]) · v[b, h/G, j],   j < n_keys,
 *
 * G = heads / kv_heads query heads sharing a K/V head (GQA). Split-K, as flash-decoding does (Dao,
 * Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"): the keys are cut into chunks of KEYS_PER_TASK; each (b, kv head, chunk) is one
 * thread's task and keeps, per query head, a partial softmax over its keys
 *
 *   m = max_j s_j,   l = Σ_j exp(s_j - m),   acc = Σ_j exp(s_j - m) · v_j
 *
 * (its chunk of K and V, 16 KiB at head_dim 64, comes from memory once and from cache for the other
 * G - 1 heads); the partials then merge with M = max_c m_c:
 *
 *   out = Σ_c exp(m_c - M) · acc_c  /  Σ_c exp(m_c - M) · l_c.
 */
#define KEYS_PER_TASK 32

#if defined(__AVX2__) && defined(__FMA__)
/* exp of 8 lanes, x <= 0 (a score minus the maximum): x = n·ln2 + r with |r| <= ln2/2, exp(r) by
 * Cephes' degree-6 polynomial (~1 ulp, as expf), 2^n put into the exponent bits. Below -87 (where
 * exp underflows float32) it gives ~1e-38 instead of 0: nothing next to the maximum's exp(0) = 1.
 * A NaN stays NaN (max_ps returns its second operand when one is NaN), as in SDPA: a NaN or an
 * infinite key makes its heads' output NaN, not a plausible number. */
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};  /* Cephes' expf, highest power first */

static __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts: n·ln2's high part exact */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[k]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* the lane sums of a[0..7], as one vector: pairs added within 128-bit halves, then the halves */
static __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

/* s[j] = scale · q·k_j for n <= KEYS_PER_TASK rows of k (`stride` floats apart); returns max_j s[j].
 * AVX2: 8 keys at a time, each its own vector sum, the 8 reduced together. */
static float scores(const float *q, const float *k, int n, int D, int64_t stride, float scale, float *s) {
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= n; j += 8) {
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (int64_t)(j + u) * stride + d), acc[u]);
        }
        _mm256_storeu_ps(s + j, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    }
#endif
    for (; j < n; j++) {
        float sum = 0.0f;
        for (int d = 0; d < D; d++) sum += q[d] * k[(int64_t)j * stride + d];
        s[j] = scale * sum;
    }
    float m = -INFINITY;
    for (j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

#if defined(__AVX512F__)
/* exp8's polynomial on 16 lanes; 2^n by scalef (the same values) */
static __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < 6; k++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[k]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* s[j] = exp(s[j] - m); returns Σ_j s[j] */
static float exps(float *s, int n, float m) {
    float l = 0.0f;
    int j = 0;
#if defined(__AVX512F__)
    __m512 sum16 = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(m)));
        _mm512_storeu_ps(s + j, e);
        sum16 = _mm512_add_ps(sum16, e);
    }
    l = _mm512_reduce_add_ps(sum16);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    __m256 sum = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    l += hsum(sum);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        l += s[j];
    }
    return l;
}

/* acc[0:D] = Σ_j p[j] · v_j over n rows of v (`stride` floats apart). AVX2: 64 columns at a time, in 8
 * vector sums. */
static void weighted_sum(const float *p, const float *v, int n, int D, int64_t stride, float *acc) {
    int d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 64 <= D; d += 64) {
        __m256 sum[8];
        for (int u = 0; u < 8; u++) sum[u] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            __m256 pj = _mm256_set1_ps(p[j]);
            for (int u = 0; u < 8; u++)
                sum[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + (int64_t)j * stride + d + 8 * u), sum[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + d + 8 * u, sum[u]);
    }
#endif
    for (; d < D; d++) {
        acc[d] = 0.0f;
        for (int j = 0; j < n; j++) acc[d] += p[j] * v[(int64_t)j * stride + d];
    }
}

/* out[0:D] from the partials of chunks first..last-1 (`part` floats apart: acc[D], m, l), D + 2 numbers a
 * chunk: out = Σ_c exp(m_c - M) · acc_c / Σ_c exp(m_c - M) · l_c, M = max_c m_c. */
static void merge(const float *p, int first, int last, int64_t part, int D, float *o) {
    float M = -INFINITY, L = 0.0f;
    for (int c = first; c < last; c++) M = p[c * part + D] > M ? p[c * part + D] : M;
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    for (int c = first; c < last; c++) {
        float w = expf(p[c * part + D] - M);
        L += w * p[c * part + D + 1];
        for (int d = 0; d < D; d++) o[d] += w * p[c * part + d];
    }
    for (int d = 0; d < D; d++) o[d] /= L;
}

/* Layouts: q, out float32 [batch, heads, head_dim]; k, v float32 with each head's rows contiguous
 * (row j at j·head_dim), heads and sequences at the given strides (a cache's [B, kv_heads,
 * max_seq_len, head_dim] buffer, or a view of its first positions). Returns 0, or 1 when the
 * partials cannot be allocated. */
int decode_attention(const float *q, const float *k, const float *v, float *out, int batch, int heads,
                     int kv_heads, int n_keys, int head_dim, int64_t k_batch_stride, int64_t k_head_stride,
                     int64_t v_batch_stride, int64_t v_head_stride, float scale, int threads) {
    int G = heads / kv_heads, chunks = (n_keys + KEYS_PER_TASK - 1) / KEYS_PER_TASK, D = head_dim;
    int64_t part = D + 2 + KEYS_PER_TASK;  /* a partial: acc[D], m, l; then room for its scores */
    float *partials = (float *)malloc(sizeof(float) * (size_t)batch * heads * chunks * part);
    if (partials == NULL) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int task = 0; task < batch * kv_heads * chunks; task++) {
        int b = task / (kv_heads * chunks), kvh = task / chunks % kv_heads, c = task % chunks;
        int first = c * KEYS_PER_TASK, n = n_keys - first < KEYS_PER_TASK ? n_keys - first : KEYS_PER_TASK;
        const float *kc = k + b * k_batch_stride + kvh * k_head_stride + (int64_t)first * D;
        const float *vc = v + b * v_batch_stride + kvh * v_head_stride + (int64_t)first * D;
        for (int g = 0; g < G; g++) {
            int64_t bh = (int64_t)b * heads + kvh * G + g;
            float *acc = partials + (bh * chunks + c) * part, *s = acc + D + 2;
            float m = scores(q + bh * D, kc, n, D, D, scale, s), l = exps(s, n, m);
            weighted_sum(s, vc, n, D, D, acc);
            acc[D] = m;
            acc[D + 1] = l;
        }
    }
    for (int bh = 0; bh < batch * heads; bh++)
        merge(partials + (int64_t)bh * chunks * part, 0, chunks, part, D, out + (int64_t)bh * D);
    free(partials);
    return 0;
}

/* Decode attention over the paged pool (minillm/serving/paged_cache.py), reading each sequence's blocks
 * where they lie instead of gathering them into a contiguous copy first (vLLM's paged_attention kernel
 * does the same on a GPU):
 *
 *   key j of sequence b:  pool[tables[b, j / block_size], j % block_size, kv head, :]
 *
 * Sequence b attends over its keys first[b] <= j < last[b] (first > 0: a sliding window). One task a
 * sequence: a batch of decodes has enough of them for every thread, so the keys are not split (as
 * decode_attention's single sequence needs) and no partials are merged. The task walks its keys a chunk
 * at a time (keys_per_task of one block, <= KEYS_PER_TASK) with the online softmax (Milakov & Gimelshein
 * 2018), for each query head: with m the running maximum, l the running sum,
 *
 *   m' = max(m, max_j s_j),   c = exp(m - m'),   l = c · l + Σ_j exp(s_j - m'),
 *   acc = c · acc + Σ_j exp(s_j - m') · v_j,     out = acc / l at the end;
 *
 * a chunk's K and V rows hold every K/V head (12 KiB each at 16 keys, 3 heads of 64): read from memory
 * once for all the heads, and the next chunk's are prefetched while this one computes (the blocks lie
 * anywhere in the pool, where the CPU's own prefetcher cannot guess them). `benchmarks/
 * paged_decode_attention.py --threads 2 --layers 30`, 32 decodes of contexts 100-600, 2026-12-02: 55.4 ms
 * a step with one task a (sequence, K/V head) and no prefetch, 36.3 ms so; 2026-12-03 (Intel Xeon, AVX-512):
 * 33.5 ms, then 31.7 with the V sums in independent chains, 28.4 with the prefetches spread over the heads
 * (39.7 without any).
 * Layouts: q, out float32 [batch, heads, head_dim]; k_pool, v_pool one layer's float32
 * [num_blocks, block_size, kv_heads, head_dim], contiguous; tables int64 [batch, max_blocks]; first,
 * last int64 [batch]; head_dim a multiple of 8. Returns 0. */
static void rescale_add(const float *p, const float *v, int n, int D, int64_t stride, float c, float *acc) {
    /* acc[0:D] = c · acc + Σ_j p[j] · v_j over n rows of v (`stride` floats apart). AVX2: 64 columns at a
     * time in 8 vector sums, so that 8 FMA chains run side by side (one chain waits ~4 cycles an FMA) */
    int d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 64 <= D; d += 64) {
        __m256 sum[8];
        for (int u = 0; u < 8; u++) sum[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * u), _mm256_set1_ps(c));
        for (int j = 0; j < n; j++) {
            __m256 pj = _mm256_set1_ps(p[j]);
            for (int u = 0; u < 8; u++)
                sum[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + (int64_t)j * stride + d + 8 * u), sum[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + d + 8 * u, sum[u]);
    }
    for (; d + 8 <= D; d += 8) {  /* what is left of a head_dim such as 80 or 96, one chain */
        __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(acc + d), _mm256_set1_ps(c));
        for (int j = 0; j < n; j++)
            sum = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + (int64_t)j * stride + d), sum);
        _mm256_storeu_ps(acc + d, sum);
    }
#endif
    for (; d < D; d++) {
        float sum = c * acc[d];
        for (int j = 0; j < n; j++) sum += p[j] * v[(int64_t)j * stride + d];
        acc[d] = sum;
    }
}

int paged_decode_attention(const float *q, const float *k_pool, const float *v_pool, float *out,
                           const int64_t *tables, const int64_t *first, const int64_t *last, int batch,
                           int heads, int kv_heads, int head_dim, int block_size, int max_blocks,
                           int keys_per_task, float scale, int threads) {
    int G = heads / kv_heads, D = head_dim;
    int64_t row = (int64_t)kv_heads * D;  /* one position's K (or V) of every head, in floats */
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int b = 0; b < batch; b++) {
        float acc[heads * D], m[heads], l[heads], s[KEYS_PER_TASK];
        for (int i = 0; i < heads * D; i++) acc[i] = 0.0f;
        for (int h = 0; h < heads; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
        const float *qb = q + (int64_t)b * heads * D;
        for (int64_t start = first[b]; start < last[b];) {
            int64_t chunk_end = (start / keys_per_task + 1) * keys_per_task;  /* chunks stay inside a block */
            int n = (int)((chunk_end < last[b] ? chunk_end : last[b]) - start);
            int64_t block = tables[(int64_t)b * max_blocks + start / block_size];
            int64_t offset = (block * block_size + start % block_size) * row;
            /* the next chunk's K and V, fetched while this one computes: a share after each head, since a
             * burst of them all at once fills the CPU's line-fill buffers and stalls the computation */
            const char *nk = NULL, *nv = NULL;
            int64_t bytes = (int64_t)keys_per_task * row * 4, share = (bytes / heads + 63) / 64 * 64;
            if (start + n < last[b]) {
                int64_t next = start + n, nblock = tables[(int64_t)b * max_blocks + next / block_size];
                nk = (const char *)(k_pool + (nblock * block_size + next % block_size) * row);
                nv = (const char *)(v_pool + (nblock * block_size + next % block_size) * row);
            }
            for (int h = 0; h < heads; h++) {
                int64_t kv = offset + (int64_t)(h / G) * D;
                float chunk_max = scores(qb + (int64_t)h * D, k_pool + kv, n, D, row, scale, s);
                float m_new = chunk_max > m[h] ? chunk_max : m[h];
                float c = expf(m[h] - m_new);  /* 0 at the first chunk (m = -inf) */
                l[h] = c * l[h] + exps(s, n, m_new);
                rescale_add(s, v_pool + kv, n, D, row, c, acc + (int64_t)h * D);
                if (nk != NULL && h * share < bytes) {
                    int64_t part = bytes - h * share < share ? bytes - h * share : share;
                    prefetch_bytes(nk + h * share, part);
                    prefetch_bytes(nv + h * share, part);
                }
                m[h] = m_new;
            }
            start += n;
        }
        float *ob = out + (int64_t)b * heads * D;
        for (int h = 0; h < heads; h++)
            for (int d = 0; d < D; d++) ob[(int64_t)h * D + d] = acc[(int64_t)h * D + d] / l[h];
    }
    return 0;
}

/* SwiGLU's activation in one pass (Shazeer 2020), over the stacked gate|up product [rows, 2F]:
 *
 *   out[r, i] = silu(g[r, i]) · u[r, i],   silu(g) = g / (1 + exp(-g)),   g, u the row's two halves
 *
 * PyTorch's F.silu(gate) * up reads and writes the whole tensor twice (a prefill step's is [2048, 3072]).
 * Split over the threads when the rows are many enough to pay for waking them. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int F, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * F > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * F, *u = g + F;
        float *o = out + r * F;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= F; i += 8) {  /* exp(-g) for -g <= 88 (finite); below g = -88, |silu(g)| < 1e-36: 0 */
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(88.0f)));
            __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            s = _mm256_blendv_ps(s, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* max_j s[j] over n values (-inf for none) */
static float row_max(const float *s, int n) {
    float m = -INFINITY;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* Quantised panels: a server's batch of rows over int8 or int4 codes, the micro-kernel above with each
 * weight dequantised in registers as it is loaded. The codes are copied once into panel order, so
 * that one step of i loads a panel's PANEL codes as whole vectors:
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

/* Prefill's attention: T queries, the last T of S positions, each over the keys up to its own (causal),
 *
 *   out[b, h, t] = Σ_{j <= S-T+t} softmax_j(scale · q[b, h, t]·k[b, h/G, j]) · v[b, h/G, j],
 *
 * as flash attention computes it (Dao et al. 2022, "FlashAttention"): a block of PANEL_ROWS queries
 * walks the keys a panel (PANEL keys) at a time, keeping per query the running max m, the running sum
 * l of exp(s - m) and the running output; each panel rescales them by exp(m_old - m_new). The scores
 * of a panel are one panel_rows product of the queries by the keys packed as a panel (kᵀ: D rows of
 * PANEL keys, packed once for all queries), the output's share one panel_rows product of the panel's
 * probabilities by the panel's values (V's rows are already PANEL columns wide, D a multiple of
 * PANEL). A block stops at its last query's last key: the causal half is never computed. SDPA's CPU
 * flash kernel took as long for causal as for full attention (2.07 against 2.12 ms at T = S = 480,
 * 9 heads, D = 64, 2 threads, Intel Xeon, 2026-12-03).
 *
 * q [B, H, T, D], k, v [B, Hkv, S, D], each with contiguous rows (D floats) and the given strides (in
 * floats) between batches, heads and positions; out [B, H, T, D] contiguous. D a multiple of PANEL.
 * Returns 0, or 1 when a scratch buffer cannot be allocated. */
int causal_attention(const float *q, const float *k, const float *v, float *out, int B, int H, int Hkv, int T,
                     int S, int D, int64_t q_sb, int64_t q_sh, int64_t q_st, int64_t k_sb, int64_t k_sh,
                     int64_t k_st, int64_t v_sb, int64_t v_sh, int64_t v_st, float scale, int threads) {
    int G = H / Hkv, key_panels = (S + PANEL - 1) / PANEL, query_blocks = (T + PANEL_ROWS - 1) / PANEL_ROWS;
    int64_t panel_floats = (int64_t)D * PANEL, failed = 0;
    float *kt = (float *)malloc(sizeof(float) * (size_t)B * Hkv * key_panels * panel_floats);  /* kᵀ, in panels */
    if (kt == NULL) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int bg = 0; bg < B * Hkv; bg++)
        for (int p = 0; p < key_panels; p++) {
            const float *kh = k + (int64_t)(bg / Hkv) * k_sb + (int64_t)(bg % Hkv) * k_sh;
            float *panel = kt + ((int64_t)bg * key_panels + p) * panel_floats;
            for (int l = 0; l < PANEL; l++) {
                int j = p * PANEL + l;
                for (int d = 0; d < D; d++) panel[(int64_t)d * PANEL + l] = j < S ? scale * kh[(int64_t)j * k_st + d] : 0.0f;
            }
        }
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        /* per thread: a block's scores s [PANEL_ROWS, PANEL] and running output acc [PANEL_ROWS, D] */
        float *s = (float *)malloc(sizeof(float) * PANEL_ROWS * (PANEL + (size_t)D));
        float *acc = s + PANEL_ROWS * PANEL;
        failed = s == NULL;
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int bh = 0; bh < B * H; bh++)
            for (int qb = query_blocks - 1; qb >= 0; qb--) {  /* the longest blocks first: the threads end together */
                if (s == NULL) continue;
                int b = bh / H, h = bh % H, t0 = qb * PANEL_ROWS, R = T - t0 < PANEL_ROWS ? T - t0 : PANEL_ROWS;
                const float *qr = q + (int64_t)b * q_sb + (int64_t)h * q_sh + (int64_t)t0 * q_st;
                const float *vh = v + (int64_t)b * v_sb + (int64_t)(h / G) * v_sh;
                const float *kth = kt + ((int64_t)b * Hkv + h / G) * key_panels * panel_floats;
                int first_pos = S - T + t0, last_pos = first_pos + R - 1;  /* the block's queries' positions */
                float m[PANEL_ROWS], l[PANEL_ROWS];
                for (int r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
                memset(acc, 0, sizeof(float) * R * D);
                for (int p = 0; p <= last_pos / PANEL; p++) {
                    int j0 = p * PANEL, n = S - j0 < PANEL ? S - j0 : PANEL;
                    panel_block(qr, q_st, kth + p * panel_floats, PANEL, D, R, s, PANEL, PANEL, 0, NULL, 0);
                    for (int r = 0; r < R; r++) {
                        float *sr = s + r * PANEL;
                        int visible = first_pos + r - j0 + 1;  /* keys j0 .. j0 + visible - 1 */
                        visible = visible < n ? visible : n;
                        float m_new = fmaxf(m[r], row_max(sr, visible));
                        if (m_new != m[r]) {  /* the running sums rescaled: exp(-inf) = 0 at the first panel */
                            float c = expf(m[r] - m_new);
                            l[r] *= c;
                            for (int d = 0; d < D; d++) acc[r * D + d] *= c;
                            m[r] = m_new;
                        }
                        l[r] += visible > 0 ? exps(sr, visible, m_new) : 0.0f;
                        for (int j = visible > 0 ? visible : 0; j < PANEL; j++) sr[j] = 0.0f;  /* masked: weight 0 */
                    }
                    for (int c0 = 0; c0 < D; c0 += PANEL)  /* acc += p · v, PANEL columns of v at a time */
                        panel_block(s, PANEL, vh + (int64_t)j0 * v_st + c0, v_st, n, R, acc + c0, D, PANEL, 1, NULL, 0);
                }
                float *o = out + (((int64_t)b * H + h) * T + t0) * D;
                for (int r = 0; r < R; r++)
                    for (int d = 0; d < D; d++) o[(int64_t)r * D + d] = acc[r * D + d] / l[r];
            }
        free(s);
    }
    free(kt);
    return failed;
}

/* RMSNorm (Zhang & Sennrich 2019) of each row of x [rows, dim], as minillm.model.RMSNorm computes it
 * in float32:
 *
 *   out[r, i] = x[r, i] · 1/sqrt(mean_i x[r, i]² + eps) · w[i]
 *
 * With `delta` (not NULL), the residual add before it, as vLLM's fused_add_rms_norm: x + delta is
 * written to `sum` (the residual stream) and normed. One call where PyTorch's ops make seven (pow,
 * mean, add, rsqrt, two products, the residual add), each a dispatch from Python; each row is read
 * from cache two or three times. */
void rms_norm(const float *x, const float *delta, float *sum, const float *w, float *out, int64_t rows, int dim,
              float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        if (delta != NULL) {
            float *s = sum + r * dim;
            for (int i = 0; i < dim; i++) s[i] = xr[i] + delta[r * dim + i];
            xr = s;
        }
        vecf squares = {0};
        int i = 0;
        for (; i + VEC <= dim; i += VEC) {
            vecf v = load_vec(xr + i);
            squares += v * v;
        }
        float ss = 0.0f;
        for (int l = 0; l < VEC; l++) ss += squares[l];
        for (; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / dim + eps);
        for (i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
    }
}
