/* RoPE (Su, Lu, Pan, Murtadha, Wen, Liu 2021, "RoFormer"), queries and keys in one call, as
 * minillm.rope.apply_rope rotates them. For a row x [D] (one token's head) and its token's cos, sin [D],
 * half = D / 2, i < half:
 *
 *   out[i]        = x[i] · cos[i] - x[i + half] · sin[i]
 *   out[i + half] = x[i + half] · cos[i + half] + x[i] · sin[i + half]
 *
 * in the lesson's order and roundings: apply_rope computes x · cos + cat(-x2, x1) · sin, so each product
 * is rounded (to float32, or for bfloat16 rows to bfloat16), then their sum. The same values bit for bit
 * (tests/fast/test_rope_kernel.py; but with AVX512-BF16 a bfloat16 product below 2^-126 becomes zero, as
 * common.h's rounding says), in one call where PyTorch dispatches six ops a tensor (chunk, neg, cat, two
 * products, the add): a decode step's rows are few, and the dispatches cost more than the arithmetic.
 */
#include "common.h"

/* A product a·b must stay rounded on its own: a compiler that contracts a·b - c·d into one fused
 * multiply-add rounds once where apply_rope rounds twice. */
#if defined(__clang__)
#define NO_CONTRACT _Pragma("clang fp contract(off)")
#define NO_CONTRACT_FN
#else
#define NO_CONTRACT
#define NO_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#endif

NO_CONTRACT_FN static void rotate_f32(const float *x, const float *c, const float *s, float *out, int half) {
    NO_CONTRACT
    int i = 0;
    for (; i + VEC <= half; i += VEC) {
        vecf x1 = load_vec(x + i), x2 = load_vec(x + half + i);
        store_vec(out + i, x1 * load_vec(c + i) - x2 * load_vec(s + i));
        store_vec(out + half + i, x2 * load_vec(c + half + i) + x1 * load_vec(s + half + i));
    }
    for (; i < half; i++) {
        out[i] = x[i] * c[i] - x[half + i] * s[i];
        out[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
    }
}

/* bfloat16 rows: a product of two bfloat16s is exact in float32, so rounding it to bfloat16 gives torch's
 * bfloat16 product; the sum of two bfloat16s is rounded to float32, then to bfloat16, as torch does too. */
NO_CONTRACT_FN static void rotate_bf16(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *out,
                                       int half) {
    NO_CONTRACT
    int i = 0;
    for (; i + VEC <= half; i += VEC) {
        vecf x1 = widen_vec(x + i), x2 = widen_vec(x + half + i);
        store_bf16(out + i, round_to_bf16(x1 * widen_vec(c + i)) - round_to_bf16(x2 * widen_vec(s + i)));
        store_bf16(out + half + i,
                   round_to_bf16(x2 * widen_vec(c + half + i)) + round_to_bf16(x1 * widen_vec(s + half + i)));
    }
    for (; i < half; i++) {
        float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[half + i]);
        float a = bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(c[i])));
        float b = bf16_to_f32(f32_to_bf16(x2 * bf16_to_f32(s[i])));
        float a2 = bf16_to_f32(f32_to_bf16(x2 * bf16_to_f32(c[half + i])));
        float b2 = bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(s[half + i])));
        out[i] = f32_to_bf16(a - b);
        out[half + i] = f32_to_bf16(a2 + b2);
    }
}

/* q [B, H, T, D] and k [B, KV, T, D] at the given element strides (batch, head, token; a head's D elements
 * contiguous), cos and sin [T, D] contiguous, all float32 or (bf16) all bfloat16: the rotated rows into
 * q_out [B, T, H, D] and k_out [B, T, KV, D], contiguous. */
void rope(const void *q, const void *k, const void *cos, const void *sin, void *q_out, void *k_out, int B, int T,
          int H, int KV, int D, int64_t qsb, int64_t qsh, int64_t qst, int64_t ksb, int64_t ksh, int64_t kst,
          int bf16, int threads) {
    int64_t elem = bf16 ? 2 : 4, rows = (int64_t)B * T;
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * (H + KV) * D > 65536)
    for (int64_t bt = 0; bt < rows; bt++) {
        int64_t b = bt / T, t = bt % T;
        const char *c = (const char *)cos + t * D * elem, *s = (const char *)sin + t * D * elem;
        for (int h = 0; h < H + KV; h++) {
            const char *x = h < H ? (const char *)q + (b * qsb + h * qsh + t * qst) * elem
                                  : (const char *)k + (b * ksb + (h - H) * ksh + t * kst) * elem;
            char *o = h < H ? (char *)q_out + (bt * H + h) * D * elem : (char *)k_out + (bt * KV + h - H) * D * elem;
            if (bf16)
                rotate_bf16((const uint16_t *)x, (const uint16_t *)c, (const uint16_t *)s, (uint16_t *)o, D / 2);
            else
                rotate_f32((const float *)x, (const float *)c, (const float *)s, (float *)o, D / 2);
        }
    }
}
