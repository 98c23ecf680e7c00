// bf16 matmul for decode steps of many rows (above the few-row kernel's): the CPU kernel.
// The launcher, its semantics and the torch reference are in tile_gemm_cpu.py.
//
// Why: in a 64-row bf16 decode step the weights of 30 layers (212 MB for SmolLM2-135M) come from
// memory, and oneDNN's packed bf16 GEMM ran 309-318 GFLOP/s over them on a 2-core Zen 4, against
// 358-379 for this plain kernel (1.16-1.19x; 1.28-1.37x at 16 rows, 1.19-1.25x at 32). In cache the
// two are within 4-8 %. The weight is packed once into 64-column panels of bf16 pairs, the layout
// the CPU's bf16 dot product (vdpbf16ps, avx512_bf16) reads: panel p, pair k, column j holds
// w[64p + j, 2k] and w[64p + j, 2k + 1]. A tile of 6 rows x 64 columns keeps 24 fp32 accumulators in
// registers; each pair of a row's inputs is broadcast once against the panel's four vectors. The
// threads split the panels. Products of two bf16 are exact in fp32 and the sums are fp32, as in the
// library's bf16 matmul; only their order differs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include <immintrin.h>

namespace tessera_tiles {

constexpr int64_t COLS = 64;  // columns per panel: four 16-lane fp32 accumulators per row

#ifdef __AVX512BF16__
constexpr bool AVAILABLE = true;

// acc rows [MR, 64] of one panel: y = x @ panel (+ bias), fp32.
template <int MR>
inline void tile(const at::BFloat16* x, int64_t K, const at::BFloat16* panel, const float* bias, float* y,
                 int64_t N) {
  __m512 acc[MR][4];
  for (int u = 0; u < 4; ++u) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * u) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][u] = b;
  }
  const int64_t pairs = K / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    const at::BFloat16* w = panel + k * 2 * COLS;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(x + m * K)[k]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, w2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, w3);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < 4; ++u) _mm512_storeu_ps(y + m * N + 16 * u, acc[m][u]);
}

// y [M, N] fp32 = x [M, K] bf16 @ w^T (+ bias [N] fp32), w given as pack(w).
inline void gemm(const at::BFloat16* x, int64_t M, const at::BFloat16* packed, const float* bias, float* y,
                 int64_t N, int64_t K) {
  at::parallel_for(0, N / COLS, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const at::BFloat16* panel = packed + p * K * COLS;
      const float* b = bias ? bias + p * COLS : nullptr;
      float* out = y + p * COLS;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) tile<6>(x + m * K, K, panel, b, out + m * N, N);
      for (; m + 2 <= M; m += 2) tile<2>(x + m * K, K, panel, b, out + m * N, N);
      for (; m < M; ++m) tile<1>(x + m * K, K, panel, b, out + m * N, N);
    }
  });
}
#else
constexpr bool AVAILABLE = false;

inline void gemm(const at::BFloat16*, int64_t, const at::BFloat16*, const float*, float*, int64_t, int64_t) {
  TORCH_CHECK(false, "tile_gemm: this build has no avx512_bf16");
}
#endif

// Whether a weight [N, K] can be packed: bf16, N a multiple of 64, K even.
inline bool fits(const at::Tensor& w) {
  return w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % COLS == 0 && w.size(1) % 2 == 0 &&
         w.size(0) > 0;
}

// w [N, K] bf16 -> [N / 64, K / 2, 64, 2] bf16 panels (see the file's head).
inline at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(fits(w), "tile_gemm: the weight must be bf16 [N, K] with N a multiple of 64 and K even");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  at::Tensor out = at::empty({N / COLS, K / 2, COLS, 2}, wc.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / COLS, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < COLS; ++j) {
        const uint16_t* row = src + (p * COLS + j) * K;
        uint16_t* col = dst + p * K * COLS + 2 * j;
        for (int64_t k = 0; k < K / 2; ++k) {
          col[k * 2 * COLS] = row[2 * k];
          col[k * 2 * COLS + 1] = row[2 * k + 1];
        }
      }
  });
  return out;
}

}  // namespace tessera_tiles

#ifndef TESSERA_NO_MODULE  // defined by decode_stack_cpu.cpp, which binds its own module
// out [M, N] fp32 = x [M, K] bf16 @ w^T (+ bias [N] fp32), packed = pack(w).
void tile_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "tile_gemm: x must be a contiguous bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == tessera_tiles::COLS && packed.size(1) * 2 == x.size(1),
              "tile_gemm: packed must be pack(w) of a weight with x's K columns");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * tessera_tiles::COLS;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "tile_gemm: out must be a contiguous fp32 [M, N]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "tile_gemm: bias must be a contiguous fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  tessera_tiles::gemm(x.data_ptr<at::BFloat16>(), M, packed.data_ptr<at::BFloat16>(), bp, out.data_ptr<float>(),
                      N, K);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", [] { return tessera_tiles::AVAILABLE; }, "whether this build has the bf16 dot product");
  m.def("pack", &tessera_tiles::pack, "w [N, K] bf16 -> 64-column panels of bf16 pairs", pybind11::arg("w"));
  m.def("tile_gemm", &tile_gemm, "out fp32 = x bf16 @ w^T (+ bias) over pack(w)", pybind11::arg("out"),
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
#endif
