// Multi-LoRA over rows (lora_rows.h) as a Python module; the launcher, its semantics and the torch reference
// are in lora_cpu.py.
#include <torch/extension.h>

#include "lora_rows.h"

namespace tessera_lora {

template <typename T>
void typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bt, const int32_t* offsets,
           const int32_t* ranks, int64_t grain, Ahead ahead) {
  const Job<T, T, T> job{x.data_ptr<T>(), x.stride(0), y.data_ptr<T>(), y.stride(0), A.data_ptr<T>(),
                         Bt.data_ptr<T>(), A.size(1), Bt.size(1), offsets, ranks, y.size(0)};
  rows<std::is_same_v<T, c10::BFloat16>>(&job, 1, grain, ahead);
}

// y [M, N] += per row (x [M, K] @ A[o:o+r]^T) @ Bt[o:o+r]; see lora_cpu.lora_rows.
void lora_rows(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bt,
               const at::Tensor& offsets, const at::Tensor& ranks, int64_t grain, int64_t prefetch) {
  TORCH_CHECK(grain > 0, "lora_rows: grain must be positive, got ", grain);
  const Ahead ahead = ahead_of(prefetch, "lora_rows");
  const auto t = y.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "lora_rows: float32 or bfloat16 only, got ", t);
  TORCH_CHECK(x.scalar_type() == t && A.scalar_type() == t && Bt.scalar_type() == t,
              "lora_rows: y, x, A and Bt must share one dtype");
  for (const at::Tensor* p : {static_cast<const at::Tensor*>(&y), &x, &A, &Bt, &offsets, &ranks})
    TORCH_CHECK(p->device().is_cpu(), "lora_rows: CPU tensors only");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && A.dim() == 2 && Bt.dim() == 2, "lora_rows: y, x, A and Bt must be 2-D");
  const int64_t M = y.size(0), N = y.size(1), K = x.size(1);
  TORCH_CHECK(x.size(0) == M, "lora_rows: x has ", x.size(0), " rows, y ", M);
  TORCH_CHECK(A.size(1) == K && Bt.size(1) == N && A.size(0) == Bt.size(0), "lora_rows: A must be [P, ", K,
              "] and Bt [P, ", N, "], got ", A.sizes(), " and ", Bt.sizes());
  TORCH_CHECK((y.stride(1) == 1 || N <= 1) && (x.stride(1) == 1 || K <= 1) && A.is_contiguous() && Bt.is_contiguous(),
              "lora_rows: A and Bt must be contiguous, x and y rows unit-strided");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && ranks.scalar_type() == at::kInt && offsets.is_contiguous() &&
                  ranks.is_contiguous() && offsets.numel() == M && ranks.numel() == M,
              "lora_rows: offsets and ranks must be contiguous int32 [", M, "]");
  const int32_t* op = offsets.data_ptr<int32_t>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  check_spans(op, rp, M, A.size(0), "lora_rows");
  if (t == at::kBFloat16) {
    typed<c10::BFloat16>(y, x, A, Bt, op, rp, grain, ahead);
  } else {
    typed<float>(y, x, A, Bt, op, rp, grain, ahead);
  }
}

}  // namespace tessera_lora

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_rows", &tessera_lora::lora_rows, "y += each row's LoRA correction from an arena, in place",
        py::arg("y"), py::arg("x"), py::arg("A"), py::arg("Bt"), py::arg("offsets"), py::arg("ranks"),
        py::arg("grain") = tessera_lora::COARSE,
        py::arg("prefetch") = static_cast<int64_t>(tessera_lora::Ahead::paced),
        py::call_guard<py::gil_scoped_release>());
}
