// The many-row matmul over quantized weights widened in cache, and grouped weights' dequantization
// (widen_gemm.h), as a Python module; the launchers, their semantics and the torch references are in
// widen_gemm_cpu.py.
#include "../../common/kernels/amx_gemm.h"
#include "widen_gemm.h"

namespace {

using namespace tessera_widen;

struct Weight {
  int64_t N, K;
};

// Checks codes uint8 [N, K * bits / 8] and scale, offset fp16 [N, K / group]; returns N and K.
Weight check_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, int64_t bits,
                    int64_t group, const char* who) {
  TORCH_CHECK(bits == 4 || bits == 8, who, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group == 16 || group == 32, who, ": group must be 16 or 32, got ", group);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() && !codes.is_cuda(),
              who, ": codes must be a contiguous CPU uint8 [N, K * bits / 8]");
  const int64_t N = codes.size(0), K = codes.size(1) * 8 / bits;
  TORCH_CHECK(K % group == 0, who, ": group ", group, " does not divide K ", K);
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 2 && t->size(0) == N && t->size(1) == K / group &&
                t->is_contiguous(), who, ": scale and offset must be float16 [N, ", K / group, "]");
  return {N, K};
}

// Checks x [M, K] and out [M, N] (both float32 or both bfloat16) and bias (fp32 [N] or none); returns M and
// bias's pointer.
std::pair<int64_t, const float*> check_rows(const at::Tensor& out, const at::Tensor& x, int64_t N, int64_t K,
                                            const c10::optional<at::Tensor>& bias, const char* who) {
  const auto t = x.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16) && out.scalar_type() == t, who,
              ": x and out must both be float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous(), who, ": x must be a contiguous [M, ", K, "]");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous(), who,
              ": out must be a contiguous [", M, ", ", N, "]");
  if (!bias.has_value()) return {M, nullptr};
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), who,
              ": bias must be float32 [N]");
  return {M, bias->data_ptr<float>()};
}

// out = x @ w^T (+ bias) for any source, products in bf16 for bf16 x and, where asked, for float32 x; on the
// tile unit (amx_gemm.h, products in bf16) where asked.
template <typename Source>
void run(at::Tensor& out, const at::Tensor& x, const Source& w, int64_t M, int64_t N, int64_t K, const float* bp,
         bool bf16_products, bool amx) {
  if (amx) {
    TORCH_CHECK(bf16_products, "widen_gemm: the tile unit multiplies in bf16");
    if (x.scalar_type() == at::kBFloat16)
      tessera_amx::gemm(x.data_ptr<at::BFloat16>(), M, w, N, K, bp, out.data_ptr<at::BFloat16>());
    else
      tessera_amx::gemm(x.data_ptr<float>(), M, w, N, K, bp, out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16)
    gemm<at::BFloat16, at::BFloat16>(x.data_ptr<at::BFloat16>(), M, w, N, K, bp, out.data_ptr<at::BFloat16>());
  else if (bf16_products)
    gemm<float, at::BFloat16>(x.data_ptr<float>(), M, w, N, K, bp, out.data_ptr<float>());
  else
    gemm<float, float>(x.data_ptr<float>(), M, w, N, K, bp, out.data_ptr<float>());
}

// out [M, N] = x [M, K] @ w^T (+ bias [N] fp32) over a grouped weight.
void gemm_grouped(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                  const at::Tensor& offset, int64_t bits, int64_t group, c10::optional<at::Tensor> bias,
                  bool bf16_products, bool amx) {
  const auto [N, K] = check_weight(codes, scale, offset, bits, group, "gemm_grouped");
  const auto [M, bp] = check_rows(out, x, N, K, bias, "gemm_grouped");
  const Grouped w{codes.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), offset.data_ptr<at::Half>(), K, group, bits};
  run(out, x, w, M, N, K, bp, bf16_products, amx);
}

// out [M, N] = x [M, K] @ (q * scale[:, None])^T (+ bias [N] fp32): q int8 [N, K], scale float32 [N].
void gemm_int8(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
               c10::optional<at::Tensor> bias, bool bf16_products, bool amx) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && !q.is_cuda(),
              "gemm_int8: q must be a contiguous CPU int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "gemm_int8: scale must be float32 [", N, "]");
  const auto [M, bp] = check_rows(out, x, N, K, bias, "gemm_int8");
  run(out, x, Int8Rows{q.data_ptr<int8_t>(), scale.data_ptr<float>(), K}, M, N, K, bp, bf16_products, amx);
}

// out [N, K] float32 or bfloat16 = the weight dequantized.
void dequantize_into(at::Tensor out, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                     int64_t bits, int64_t group) {
  const auto [N, K] = check_weight(codes, scale, offset, bits, group, "dequantize");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize: out must be a contiguous float32 or bfloat16 [", N, ", ", K, "]");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  const at::Half* op = offset.data_ptr<at::Half>();
  if (out.scalar_type() == at::kFloat)
    dequantize(cp, sp, op, N, K, group, bits, out.data_ptr<float>());
  else
    dequantize(cp, sp, op, N, K, group, bits, out.data_ptr<at::BFloat16>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", [](bool bf16) { return available(bf16 ? at::kBFloat16 : at::kFloat); },
        "whether this build runs the many-row kernel's products in bf16 (the bf16 dot product) or fp32 (AVX-512)",
        py::arg("bf16"));
  m.def("amx", &tessera_amx::available, "whether this build and CPU run the many-row kernel on the tile unit (AMX bf16)");
  m.def("gemm_grouped", &gemm_grouped, "out = x @ w^T (+ bias) over a grouped weight, widened block by block",
        py::arg("out"), py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("bits"),
        py::arg("group"), py::arg("bias"), py::arg("bf16_products"), py::arg("amx"), py::call_guard<py::gil_scoped_release>());
  m.def("gemm_int8", &gemm_int8, "out = x @ (q * scale)^T (+ bias) over an int8 weight, widened block by block",
        py::arg("out"), py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bias"), py::arg("bf16_products"),
        py::arg("amx"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize_into, "out [N, K] (float32 or bfloat16) = the grouped weight dequantized",
        py::arg("out"), py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("bits"), py::arg("group"),
        py::call_guard<py::gil_scoped_release>());
}
