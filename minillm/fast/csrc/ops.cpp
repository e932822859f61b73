/* The kernels of products.c, bf16_amx.c, quantized.c (with quantized_vnni.c), quantized_amx.c and attention.c as
 * torch ops (torch.ops.minillm.f32_matvec, ...): how a torch.compile'd decode step calls them.
 *
 * A compiled graph cannot call ctypes, so it calls an op. An op whose implementation is Python
 * costs the graph ~26-34 us a call (the dispatcher calling back into Python), this one ~9 us
 * including a small product (developers' EPYC): SmolLM2's compiled step, 121 calls, ran 1.2-1.3 ms faster.
 * minillm/fast/kernels.py defines the ops' schemas, builds this file at the first compile
 * (c++ against torch's headers, 12-19 s measured, kept beside the C library) and falls back to Python
 * implementations where it cannot.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include <math.h>  /* the C files' headers, included first as C++: within extern "C" they are then skipped */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
extern "C" {
#include "products.c"
#include "bf16_amx.c"
#include "quantized_vnni.c"
#include "quantized.c"
#include "quantized_amx.c"
#include "attention.c"
}

namespace {

/* y [rows of x, out] float32, for a product that writes every element */
at::Tensor output(const at::Tensor &x, int64_t out) { return at::empty({x.size(0), out}, x.options()); }

void check_x(const at::Tensor &x, int64_t in, const char *op) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in, op,
                " takes x float32 [rows, ", in, "], got ", x.scalar_type(), " ", x.sizes());
}

/* What the C loops would read out of bounds or wrongly (they trust shapes); int4 when zero is given. */
void check_codes(const at::Tensor &codes, const at::Tensor &scale, const at::Tensor *zero, int64_t group_size,
                 const char *op) {
    bool int4 = zero != nullptr;
    TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == (int4 ? at::kByte : at::kChar),
                op, ": codes must be a contiguous 2-D ", int4 ? "uint8" : "int8", " tensor, got ",
                codes.scalar_type(), " ", codes.sizes());
    int64_t in = codes.size(1) * (int4 ? 2 : 1), groups = 1;
    if (int4) {
        TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && in % group_size == 0, op,
                    ": group_size must be a positive multiple of 16 dividing ", in, ", got ", group_size);
        groups = in / group_size;
    }
    std::vector<int64_t> expected = int4 ? std::vector<int64_t>{codes.size(0), groups} : std::vector<int64_t>{codes.size(0)};
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.sizes() == expected, op,
                ": scale must be contiguous float32 ", at::IntArrayRef(expected), ", got ", scale.scalar_type(), " ",
                scale.sizes());
    if (int4)
        TORCH_CHECK(zero->scalar_type() == at::kByte && zero->is_contiguous() && zero->sizes() == expected, op,
                    ": zero must be contiguous uint8 ", at::IntArrayRef(expected), ", got ", zero->scalar_type(), " ",
                    zero->sizes());
}

at::Tensor f32_matvec_op(const at::Tensor &x, const at::Tensor &weight) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous(),
                "f32_matvec takes a contiguous float32 weight [out, in]");
    check_x(x, weight.size(1), "f32_matvec");
    at::Tensor xc = x.contiguous(), y = output(xc, weight.size(0));
    f32_matvec(xc.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), xc.size(0), weight.size(0),
               weight.size(1), at::get_num_threads());
    return y;
}

/* bfloat16 rows on the matrix units, the weight in place; bias bfloat16 [out] or none, added before the one rounding */
at::Tensor bf16_amx_matmul_op(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    bool ok = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
              weight.dim() == 2 && weight.is_contiguous() && x.size(1) == weight.size(1) && x.size(0) > 0 &&
              x.device().is_cpu() && weight.device().is_cpu() &&
              (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 &&
                                     bias->size(0) == weight.size(0) && bias->device().is_cpu()));
    TORCH_CHECK(ok, "bf16_amx_matmul takes bfloat16 CPU x [rows, in], a contiguous weight [out, in] and bias [out] or "
                "none, got x ", x.scalar_type(), " ", x.sizes(), ", weight ", weight.scalar_type(), " ",
                weight.sizes());
    at::Tensor xc = x.contiguous(), y = at::empty({x.size(0), weight.size(0)}, x.options());
    std::optional<at::Tensor> bias32;
    if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();
    int status = bf16_amx_matmul((const uint16_t *)xc.data_ptr(), (const uint16_t *)weight.data_ptr(),
                                 bias32 ? bias32->data_ptr<float>() : nullptr, (uint16_t *)y.data_ptr(), xc.size(0),
                                 weight.size(0), weight.size(1), at::get_num_threads());
    TORCH_CHECK(status != 1, "bf16_amx_matmul could not allocate x's packed copy");
    TORCH_CHECK(status == 0, "bf16_amx_matmul needs in a multiple of 32, out a multiple of 16 and a CPU with AMX-BF16 "
                "(bf16_amx_ready), got weight ", weight.sizes());
    return y;
}

/* The C functions of a product of codes, one for each format (all three products share these signatures) */
using Int8Product = int (*)(const float *, const int8_t *, const float *, float *, int, int, int, int);
using Int4Product = int (*)(const float *, const uint8_t *, const float *, const uint8_t *, float *, int, int, int, int,
                            int);

/* x @ ŵᵀ for int8 (no zero) or int4 codes. A C function returns 1 when it could not allocate its ``buffers``, 2 for
 * shapes or a CPU it does not take (``needs`` says which). */
at::Tensor codes_product(const char *op, Int8Product int8, Int4Product int4, const char *buffers, const char *needs,
                         const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                         const std::optional<at::Tensor> &zero, int64_t group_size) {
    bool int4_codes = zero.has_value();
    check_codes(codes, scale, int4_codes ? &*zero : nullptr, group_size, op);
    check_x(x, codes.size(1) * (int4_codes ? 2 : 1), op);
    at::Tensor xc = x.contiguous(), y = output(xc, codes.size(0));
    if (xc.size(0) == 0) return y;
    int status = int4_codes ? int4(xc.data_ptr<float>(), codes.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                   zero->data_ptr<uint8_t>(), y.data_ptr<float>(), xc.size(0), codes.size(0),
                                   xc.size(1), group_size, at::get_num_threads())
                            : int8(xc.data_ptr<float>(), codes.data_ptr<int8_t>(), scale.data_ptr<float>(),
                                   y.data_ptr<float>(), xc.size(0), codes.size(0), xc.size(1), at::get_num_threads());
    TORCH_CHECK(status != 1, op, " could not allocate ", buffers);
    TORCH_CHECK(status == 0, op, " needs ", needs, ", got codes ", codes.sizes());
    return y;
}

at::Tensor quantized_matvec_op(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                               const std::optional<at::Tensor> &zero, int64_t group_size) {
    return codes_product("quantized_matvec", int8_matvec, int4_matvec, "its copy of x", "", x, codes, scale, zero,
                         group_size);
}

/* on the matrix units, x as four int8 digits a value */
at::Tensor quantized_amx_matmul_op(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                                   const std::optional<at::Tensor> &zero, int64_t group_size) {
    return codes_product("quantized_amx_matmul", int8_amx_matmul, int4_amx_matmul, "x's digits",
                         "in a multiple of 64, out a multiple of 16 (int4: group_size a multiple of 64) and a CPU with "
                         "AMX-INT8 (quantized_amx_ready)", x, codes, scale, zero, group_size);
}

at::Tensor quantized_matmul_op(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                               const std::optional<at::Tensor> &zero, int64_t group_size) {
    return codes_product("quantized_matmul", int8_matmul, int4_matmul, "its copy of x and its tiles", "", x, codes,
                         scale, zero, group_size);
}

at::Tensor dequantize_op(const at::Tensor &codes, const at::Tensor &scale, const std::optional<at::Tensor> &zero,
                         int64_t group_size) {
    bool int4 = zero.has_value();
    check_codes(codes, scale, int4 ? &*zero : nullptr, group_size, "dequantize");
    int64_t out = codes.size(0), in = codes.size(1) * (int4 ? 2 : 1);
    at::Tensor w = at::empty({out, in}, scale.options());
    if (int4)
        int4_dequantize(codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero->data_ptr<uint8_t>(),
                        w.data_ptr<float>(), out, in, group_size, at::get_num_threads());
    else
        int8_dequantize(codes.data_ptr<int8_t>(), scale.data_ptr<float>(), w.data_ptr<float>(), out, in,
                        at::get_num_threads());
    return w;
}

at::Tensor decode_attention_op(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &n_keys,
                               double scale) {
    TORCH_CHECK(n_keys.numel() == 1 && n_keys.device().is_cpu() && !n_keys.is_floating_point() && q.device().is_cpu() &&
                k.device().is_cpu() && v.device().is_cpu(), "decode_attention takes CPU tensors and n_keys a one-element "
                "integer tensor, got n_keys ", n_keys.scalar_type(), " ", n_keys.sizes(), " on ", n_keys.device());
    int64_t D = q.dim() == 4 ? q.size(3) : 0, n = n_keys.item<int64_t>();
    bool ok = q.dim() == 4 && q.size(2) == 1 && D > 0 && D % 8 == 0 && k.dim() == 4 && k.sizes() == v.sizes() &&
              k.size(0) == q.size(0) && k.size(3) == D && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
              k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
              k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D && 1 <= n && n <= k.size(2);
    TORCH_CHECK(ok, "decode_attention takes float32 (or all bfloat16) q [B, heads, 1, D] (D a multiple of 8) and k, v "
                "[B, kv_heads, S, D] with contiguous rows, heads a multiple of kv_heads, 1 <= n_keys <= S; got q ",
                q.scalar_type(), " ", q.sizes(), ", k ", k.scalar_type(), " ", k.sizes(), " strides ", k.strides(),
                ", n_keys ", n);
    bool bf16 = q.scalar_type() == at::kBFloat16;
    at::Tensor qc = q.contiguous().to(at::kFloat), out = at::empty(q.sizes(), qc.options());
    int status = decode_attention(qc.data_ptr<float>(), k.data_ptr(), v.data_ptr(), bf16, out.data_ptr<float>(),
                                  q.size(0), q.size(1), k.size(1), n, D, k.stride(0), k.stride(1), v.stride(0),
                                  v.stride(1), (float)scale, at::get_num_threads());
    TORCH_CHECK(status == 0, "decode_attention could not allocate its partial results or a thread's float32 copy");
    return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(minillm, CPU, m) {
    m.impl("f32_matvec", &f32_matvec_op);
    m.impl("bf16_amx_matmul", &bf16_amx_matmul_op);
    m.impl("quantized_matvec", &quantized_matvec_op);
    m.impl("quantized_matmul", &quantized_matmul_op);
    m.impl("quantized_amx_matmul", &quantized_amx_matmul_op);
    m.impl("dequantize", &dequantize_op);
    m.impl("decode_attention", &decode_attention_op);
}
