// Few-row matmul for decode on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (* scale[n]) (+ bias[n]).
//
// At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
// weights once; the library GEMMs are tuned for many rows and read the weights at about half
// the rate the machine streams them (issue 10). This loop streams each weight row once for all
// M <= 4 rows of x: x stays in L1, four weight rows are reduced at a time (independent
// accumulators, so the FMA latency is hidden), and the rows are split over the threads.
// Weights are float32, bfloat16 (widened exactly to fp32) or int8 with one fp32 scale per row
// (weight-only int8, model/quantization.py); x is fp32 and the sums are fp32.
// `#pragma omp simd reduction` lets the compiler vectorise the k loop for whatever -march=native
// offers (AVX-512 on these machines) without intrinsics.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int64_t NB = 4;  // weight rows reduced together

template <typename W, int M>
void rows_block(const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, float* acc /* [M, N] */,
                int64_t N) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    const W* w0 = w + n * K;
    const W* w1 = w0 + K;
    const W* w2 = w1 + K;
    const W* w3 = w2 + K;
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t k = 0; k < K; ++k) {
        float xv = xm[k];
        a0 += xv * widen(w0[k]);
        a1 += xv * widen(w1[k]);
        a2 += xv * widen(w2[k]);
        a3 += xv * widen(w3[k]);
      }
      float* out = acc + m * N + n;
      out[0] = a0;
      out[1] = a1;
      out[2] = a2;
      out[3] = a3;
    }
  }
  for (; n < n1; ++n) {
    const W* wn = w + n * K;
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t k = 0; k < K; ++k) a += xm[k] * widen(wn[k]);
      acc[m * N + n] = a;
    }
  }
}

template <typename W, int M>
void run(const float* x, const W* w, const float* scale, const float* bias, float* y, int64_t N, int64_t K) {
  // Blocks of weight rows per task: whole NB groups, at least 64 rows so a task is worth starting.
  const int64_t grain = 64;
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    rows_block<W, M>(x, w, K, n0, n1, y, N);
    for (int m = 0; m < M; ++m) {
      float* ym = y + m * N;
      for (int64_t n = n0; n < n1; ++n) {
        float v = ym[n];
        if (scale) v *= scale[n];
        if (bias) v += bias[n];
        ym[n] = v;
      }
    }
  });
}

template <typename W>
void dispatch_rows(int64_t M, const float* x, const W* w, const float* scale, const float* bias, float* y,
                   int64_t N, int64_t K) {
  switch (M) {
    case 1: return run<W, 1>(x, w, scale, bias, y, N, K);
    case 2: return run<W, 2>(x, w, scale, bias, y, N, K);
    case 3: return run<W, 3>(x, w, scale, bias, y, N, K);
    case 4: return run<W, 4>(x, w, scale, bias, y, N, K);
    default: TORCH_CHECK(false, "gemv: at most 4 rows, got ", M);
  }
}

// out [M, N] fp32 = x [M, K] fp32 @ w[N, K]^T (* scale [N] fp32) (+ bias [N] fp32); all contiguous.
void gemv(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "gemv: x, w and out must be 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "gemv: w is [", N, ", ", w.size(1), "] but x has ", K, " columns");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "gemv: out must be [", M, ", ", N, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "gemv: x and out must be float32");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "gemv: tensors must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "gemv: CPU tensors only");
  const float* sp = nullptr;
  const float* bp = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == N && scale->is_contiguous(),
                "gemv: scale must be float32 [N]");
    sp = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "gemv: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(!sp, "gemv: scale is for int8 weights");
      return dispatch_rows(M, xp, w.data_ptr<float>(), sp, bp, yp, N, K);
    case at::kBFloat16:
      TORCH_CHECK(!sp, "gemv: scale is for int8 weights");
      return dispatch_rows(M, xp, w.data_ptr<at::BFloat16>(), sp, bp, yp, N, K);
    case at::kChar:
      TORCH_CHECK(sp, "gemv: int8 weights need a scale");
      return dispatch_rows(M, xp, w.data_ptr<int8_t>(), sp, bp, yp, N, K);
    default:
      TORCH_CHECK(false, "gemv: weights must be float32, bfloat16 or int8, got ", w.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "few-row matmul over fp32/bf16/int8 weights (fp32 math)", py::arg("out"), py::arg("x"),
        py::arg("w"), py::arg("scale"), py::arg("bias"), py::call_guard<py::gil_scoped_release>());
}
