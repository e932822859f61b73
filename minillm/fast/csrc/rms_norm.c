/* RMSNorm (Zhang & Sennrich 2019) of each row of x [rows, dim], as minillm.model.RMSNorm computes it
 * in float32:
 *
 *   out[r, i] = x[r, i] · 1/sqrt(mean_i x[r, i]² + eps) · w[i]
 *
 * and in bfloat16 as it does for a bfloat16 model (HF Llama's order: the sum of squares and the scaling in
 * float32, rounded to bfloat16, then times the bfloat16 weight, rounded again; the residual add rounded too):
 *
 *   sum = bf16(x + delta),  out[r, i] = bf16(w[i] · bf16(sum[r, i] · 1/sqrt(mean_i sum[r, i]² + eps)))
 *
 * rms_norm computes rms_norm_reference's values, the squares summed in vector lanes:
 * tests/fast/test_fast_block.py checks it, native and portable builds, against float64 RMSNorm, and this
 * reference against it too.
 */
#include "common.h"

/* The scalar reference. */
void rms_norm_reference(const float *x, const float *w, float *out, int64_t rows, int dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float squares = 0.0f;
        for (int i = 0; i < dim; i++) squares += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(squares / dim + eps);
        for (int i = 0; i < dim; i++) out[r * dim + i] = xr[i] * inv * w[i];
    }
}

/* 1/sqrt(mean_i x[i]² + eps) of one row, the squares summed in vector lanes */
static float inverse_rms(const float *x, int dim, float eps) {
    vecf squares = {0};
    int i = 0;
    for (; i + VEC <= dim; i += VEC) {
        vecf v = load_vec(x + i);
        squares += v * v;
    }
    float ss = 0.0f;
    for (int l = 0; l < VEC; l++) ss += squares[l];
    for (; i < dim; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / dim + eps);
}

/* The fast one. With `delta` (not NULL), the residual add before it, as vLLM's fused_add_rms_norm:
 * x + delta is written to `sum` (the residual stream) and normed. One call where PyTorch's ops make seven (pow,
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
        float inv = inverse_rms(xr, dim, eps);
        for (int i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* The bfloat16 one (x, delta, sum, w, out bfloat16: uint16_t), the float32 one's loop with the lesson's
 * roundings (above). */
void rms_norm_bf16(const uint16_t *x, const uint16_t *delta, uint16_t *sum, const uint16_t *w, uint16_t *out,
                   int64_t rows, int dim, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *o = out + r * dim;
        if (delta != NULL) {
            uint16_t *s = sum + r * dim;
            const uint16_t *d = delta + r * dim;
            int i = 0;
            for (; i + VEC <= dim; i += VEC) store_bf16(s + i, widen_vec(xr + i) + widen_vec(d + i));
            for (; i < dim; i++) s[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(d[i]));
            xr = s;
        }
        float xf[dim];  /* the row widened once: the sum of squares and the scaling read it in float32 */
        widen_bf16(xr, xf, dim);
        float inv = inverse_rms(xf, dim, eps);
        int i = 0;
        for (; i + VEC <= dim; i += VEC) store_bf16(o + i, widen_vec(w + i) * round_to_bf16(load_vec(xf + i) * inv));
        for (; i < dim; i++) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(xf[i] * inv)));
    }
}
