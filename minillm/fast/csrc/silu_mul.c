/* SwiGLU's activation (Shazeer 2020) in one pass, over the stacked gate|up product [rows, 2F]:
 *
 *   out[r, i] = silu(g[r, i]) · u[r, i],   silu(g) = g / (1 + exp(-g)),   g, u the row's two halves
 *
 * silu_mul computes silu_mul_reference's values, exp by common.h's exp8 (~1 ulp): tests/fast/test_silu_mul.py
 * checks it, native and portable builds, against float64 F.silu(gate) · up, and this reference against
 * it too.
 */
#include "common.h"

/* The scalar reference. */
void silu_mul_reference(const float *gate_up, float *out, int64_t rows, int F) {
    for (int64_t r = 0; r < rows; r++)
        for (int i = 0; i < F; i++) {
            float g = gate_up[r * 2 * F + i], u = gate_up[r * 2 * F + F + i];
            out[r * F + i] = g / (1.0f + expf(-g)) * u;
        }
}

/* PyTorch's F.silu(gate) * up reads and writes the whole tensor twice (a prefill step's is [2048, 3072]).
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

/* The bfloat16 one (gate_up, out bfloat16: uint16_t), with the lesson's roundings: F.silu(gate) computed in float32
 * and rounded to bfloat16, then its product with up rounded (PyTorch's two bfloat16 ops). The exp is exp16's (~1
 * ulp, where PyTorch's is SLEEF's): the float32 silu can differ in its last bit, and so, rarely, its bfloat16. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int F, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * F > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * F, *u = g + F;
        uint16_t *o = out + r * F;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= F; i += 16) {  /* exp(-g) overflows to inf below g = -88: silu is then -0, as g / inf */
            __m512 x = (__m512)widen_vec(g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            store_bf16(o + i, round_to_bf16((vecf)s) * widen_vec(u + i));
        }
#endif
        for (; i < F; i++) {
            float x = bf16_to_f32(g[i]), s = bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x))));
            o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}

/* 1 where silu_mul_bf16 runs its vector loop (AVX-512); elsewhere its scalar loop is slower than PyTorch's ops. */
int silu_mul_bf16_vectorised(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
