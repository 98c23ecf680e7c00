// Dense weights on the CPU's tile unit (amx_gemm.h): a bf16 weight's panels and the matmul over them, and an fp32
// weight split in bf16 halves with the matmul that forms each product from them; the launchers, their semantics
// and the torch references are in services/common/tile_unit.py.
#include "amx_gemm.h"

namespace {

// Checks x [M, K] and out [M, N] (float32 or bfloat16; both float32 where `fp32`) and bias (fp32 [N] or none), and
// that panels holds `copies` panel_size(N, K) of bf16; returns M and bias's pointer.
std::pair<int64_t, const float*> check(const at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                                       int64_t N, int64_t copies, const c10::optional<at::Tensor>& bias, bool fp32,
                                       const char* who) {
  TORCH_CHECK(tessera_amx::available(), who, ": this CPU, build or kernel does not run the tile unit");
  const auto t = x.scalar_type();
  TORCH_CHECK((t == at::kFloat || (t == at::kBFloat16 && !fp32)) && out.scalar_type() == t, who,
              fp32 ? ": x and out must be float32" : ": x and out must both be float32 or both bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), who, ": x must be a contiguous [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous(), who,
              ": out must be a contiguous [", M, ", ", N, "]");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.numel() == copies * tessera_amx::panel_size(N, K),
              who, ": panels must be ", copies == 1 ? "pack_panels" : "pack_split_panels", " of an [", N, ", ", K,
              "] weight");
  if (!bias.has_value()) return {M, nullptr};
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), who,
              ": bias must be float32 [N]");
  return {M, bias->data_ptr<float>()};
}

// out: amx_gemm.h's panels of a bf16 weight w [N, K].
void pack_panels(at::Tensor out, const at::Tensor& w) {
  TORCH_CHECK(tessera_amx::available(), "pack_panels: this CPU, build or kernel does not run the tile unit");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && !w.is_cuda(),
              "pack_panels: w must be a contiguous CPU bfloat16 [N, K]");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                  out.numel() == tessera_amx::panel_size(w.size(0), w.size(1)),
              "pack_panels: out must be a contiguous bfloat16 of panel_size(N, K)");
  tessera_amx::pack(w.data_ptr<at::BFloat16>(), w.size(0), w.size(1), out.data_ptr<at::BFloat16>());
}

// out [M, N] = x [M, K] @ w^T (+ bias [N] fp32) over pack_panels(w), in x's dtype.
void gemm_panels(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, int64_t N,
                 c10::optional<at::Tensor> bias) {
  const auto [M, bp] = check(out, x, panels, N, 1, bias, false, "gemm_panels");
  const int64_t K = x.size(1);
  if (x.scalar_type() == at::kBFloat16)
    tessera_amx::gemm_packed(x.data_ptr<at::BFloat16>(), M, panels.data_ptr<at::BFloat16>(), N, K, bp,
                             out.data_ptr<at::BFloat16>());
  else
    tessera_amx::gemm_packed(x.data_ptr<float>(), M, panels.data_ptr<at::BFloat16>(), N, K, bp, out.data_ptr<float>());
}

// out [M, N] = x [M, K] @ w^T (+ bias [N]), all float32, over split panels: pack_panels of bf16(w) followed by
// pack_panels of bf16(w - bf16(w)), each product as three bf16 products (amx_gemm.h's gemm_split).
void gemm_panels_split(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, int64_t N,
                       c10::optional<at::Tensor> bias) {
  const auto [M, bp] = check(out, x, panels, N, 2, bias, true, "gemm_panels_split");
  tessera_amx::gemm_split(x.data_ptr<float>(), M, panels.data_ptr<at::BFloat16>(), N, x.size(1), bp,
                          out.data_ptr<float>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx", &tessera_amx::available, "whether this build and CPU run the tile unit (AMX bf16)");
  m.def("panel_size", &tessera_amx::panel_size, "bf16 elements of pack_panels' output for an [N, K] weight",
        py::arg("N"), py::arg("K"));
  m.def("pack_panels", &pack_panels, "out = the tile unit's panels of a bf16 weight [N, K]", py::arg("out"),
        py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("gemm_panels", &gemm_panels, "out = x @ w^T (+ bias) over pack_panels(w), on the tile unit", py::arg("out"),
        py::arg("x"), py::arg("panels"), py::arg("N"), py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("gemm_panels_split", &gemm_panels_split,
        "out = x @ w^T (+ bias) over split panels, fp32, each product as three bf16 products on the tile unit",
        py::arg("out"), py::arg("x"), py::arg("panels"), py::arg("N"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
}
