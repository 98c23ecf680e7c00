// The panel matmul for many-row decode steps (tile_gemm.h) as a Python module; the launcher, its
// semantics and the torch reference are in tile_gemm_cpu.py.
#include "tile_gemm.h"

// out [M, N] fp32 = x [M, K] @ w^T (+ bias [N] fp32), packed = pack(w), x in w's dtype; next: tessera_tiles::gemm's.
void tile_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias,
               bool next) {
  const auto t = packed.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == t && x.is_contiguous(),
              "tile_gemm: x must be a contiguous [M, K] in the weight's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * tessera_tiles::COLS;
  TORCH_CHECK((t == at::kFloat && packed.dim() == 3 && packed.size(1) == K && packed.size(2) == tessera_tiles::COLS) ||
                  (t == at::kBFloat16 && packed.dim() == 4 && packed.size(1) * 2 == K &&
                   packed.size(2) == tessera_tiles::COLS),
              "tile_gemm: packed must be pack(w) of a weight with x's K columns");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "tile_gemm: out must be a contiguous fp32 [M, N]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "tile_gemm: bias must be a contiguous fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  if (t == at::kFloat) {
    tessera_tiles::gemm(x.data_ptr<float>(), M, packed.data_ptr<float>(), bp, out.data_ptr<float>(), N, K, next);
  } else {
    tessera_tiles::gemm(x.data_ptr<at::BFloat16>(), M, packed.data_ptr<at::BFloat16>(), bp, out.data_ptr<float>(),
                        N, K, next);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", [](bool bf16) { return tessera_tiles::available(bf16 ? at::kBFloat16 : at::kFloat); },
        "whether this build runs the kernel for bf16 (the bf16 dot product) or fp32 (AVX-512) weights",
        pybind11::arg("bf16"));
  m.def("pack", &tessera_tiles::pack, "w [N, K] fp32 or bf16 -> 64-column panels", pybind11::arg("w"));
  m.def("tile_gemm", &tile_gemm, "out fp32 = x @ w^T (+ bias) over pack(w)", pybind11::arg("out"),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("next") = true,
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
