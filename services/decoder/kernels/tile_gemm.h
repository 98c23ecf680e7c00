// fp32 or bf16 matmul for decode steps of many rows (above the few-row kernel's): the CPU kernel.
// The launcher, its semantics and the torch reference are in tile_gemm_cpu.py.
//
// Why: in a 64-row bf16 decode step the weights of 30 layers (212 MB for SmolLM2-135M) come from
// memory, and oneDNN's packed bf16 GEMM ran 309-318 GFLOP/s over them on a 2-core Zen 4, against
// 358-379 for this plain kernel (1.16-1.19x; 1.28-1.37x at 16 rows, 1.19-1.25x at 32). In cache the
// two are within 4-8 %. fp32 gains less (1.05-1.07x at 64 rows, 1.17-1.23x at 16). The weight is packed
// once into 64-column panels: for bf16, of pairs, the layout the CPU's bf16 dot product (vdpbf16ps,
// avx512_bf16) reads (panel p, pair k, column j holds w[64p + j, 2k] and w[64p + j, 2k + 1]); for fp32,
// one input's 64 weights after another. A tile of 6 rows x 64 columns keeps 24 fp32 accumulators in
// registers; each input (bf16: pair of inputs) of a row is broadcast once against the panel's four
// vectors. The threads split the panels. The sums are fp32 (bf16 products are exact in fp32), as in
// the library's matmul; only their order differs.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include <immintrin.h>

namespace tessera_tiles {

constexpr int64_t COLS = 64;  // columns per panel: four 16-lane fp32 accumulators per row

#ifdef __AVX512F__
constexpr bool AVAILABLE_F32 = true;
#else
constexpr bool AVAILABLE_F32 = false;
#endif
#ifdef __AVX512BF16__
constexpr bool AVAILABLE_BF16 = true;
#else
constexpr bool AVAILABLE_BF16 = false;
#endif

inline bool available(at::ScalarType t) {
  return t == at::kBFloat16 ? AVAILABLE_BF16 : t == at::kFloat && AVAILABLE_F32;
}

// Whether a weight [N, K] can be packed: fp32 or bf16, N a positive multiple of 64, and for bf16 K even.
inline bool fits(const at::Tensor& w) {
  const auto t = w.scalar_type();
  return w.dim() == 2 && (t == at::kFloat || (t == at::kBFloat16 && w.size(1) % 2 == 0)) &&
         w.size(0) % COLS == 0 && w.size(0) > 0;
}

#ifdef __AVX512F__
// y rows [MR, 64] of one panel = x @ panel (+ bias), fp32 sums: fp32 x and panels by FMA, one column of
// the panel (64 weights of one input) per step.
template <int MR>
inline void tile(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                 const char* ahead) {
  __m512 acc[MR][4];
  for (int u = 0; u < 4; ++u) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * u) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][u] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    if (ahead) _mm_prefetch(ahead + 64 * k, _MM_HINT_T1);
    const float* w = panel + k * COLS;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32),
                 w3 = _mm512_loadu_ps(w + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(a, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(a, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(a, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < 4; ++u) _mm512_storeu_ps(y + m * N + 16 * u, acc[m][u]);
}
#endif

#ifdef __AVX512BF16__
// The same for bf16: a pair of inputs per step, broadcast once against the panel's four vectors of pairs.
template <int MR>
inline void tile(const at::BFloat16* x, int64_t K, const at::BFloat16* panel, const float* bias, float* y,
                 int64_t N, const char* ahead) {
  __m512 acc[MR][4];
  for (int u = 0; u < 4; ++u) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * u) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][u] = b;
  }
  const int64_t pairs = K / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    if (ahead) _mm_prefetch(ahead + 64 * k, _MM_HINT_T1);
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
#endif

// y [M, N] fp32 = x [M, K] @ w^T (+ bias [N] fp32), x in w's dtype (T: float or BFloat16), w given as pack(w).
// next: whether the tiles after a panel's first ask the thread's next panel into L2 (a cache line per step of
// theirs, while they read this panel from L2: it came from memory in the first tile). Over SmolLM2's 30 layers'
// panels from memory (2 threads) it took 8-64-row calls 6-26% less time in fp32 and 9-25% in bf16 on an Intel
// Xeon (family 6 model 167), 10-28% at 32 rows and nothing at 8-16 on a Zen 5 (family 26 model 2). It only
// asks for lines, so the sums are the same either way; false (tests, the A/B) reads as before.
template <typename T>
inline void gemm(const T* x, int64_t M, const T* packed, const float* bias, float* y, int64_t N, int64_t K,
                 bool next = true) {
  TORCH_CHECK(available(c10::CppTypeToScalarType<T>::value), "tile_gemm: this build has no kernel for ",
              c10::CppTypeToScalarType<T>::value);
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || AVAILABLE_BF16) {
    const int64_t steps = std::is_same_v<T, float> ? K : K / 2, panel_bytes = K * COLS * sizeof(T);
    at::parallel_for(0, N / COLS, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const T* panel = packed + p * K * COLS;
        const float* b = bias ? bias + p * COLS : nullptr;
        float* out = y + p * COLS;
        const char* following = next && p + 1 < p1 ? reinterpret_cast<const char*>(panel + K * COLS) : nullptr;
        auto ahead = [&](int64_t t) -> const char* {
          return following && t > 0 && (t - 1) * steps * 64 < panel_bytes ? following + (t - 1) * steps * 64 : nullptr;
        };
        int64_t m = 0, t = 0;
        for (; m + 6 <= M; m += 6, ++t) tile<6>(x + m * K, K, panel, b, out + m * N, N, ahead(t));
        // The last 1-5 rows in one tile, so the panel is read once more at most (a 5-row step in tiles of
        // 2, 2 and 1 read it three times, and took longer than a 6-row step on a Zen 4). A row's sums are
        // the same in a tile of any height.
        const T* xm = x + m * K;
        float* ym = out + m * N;
        switch (M - m) {
          case 5: tile<5>(xm, K, panel, b, ym, N, ahead(t)); break;
          case 4: tile<4>(xm, K, panel, b, ym, N, ahead(t)); break;
          case 3: tile<3>(xm, K, panel, b, ym, N, ahead(t)); break;
          case 2: tile<2>(xm, K, panel, b, ym, N, ahead(t)); break;
          case 1: tile<1>(xm, K, panel, b, ym, N, ahead(t)); break;
          default: break;
        }
      }
    });
  }
#endif
}

// w [N, K] -> panels: fp32 [N / 64, K, 64] (panel p, input k, column j = w[64p + j, k]); bf16
// [N / 64, K / 2, 64, 2] (panel p, pair k, column j = w[64p + j, 2k:2k + 2]).
inline at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(fits(w), "tile_gemm: the weight must be fp32 or bf16 [N, K] with N a multiple of 64 (and K even "
                       "for bf16)");
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == at::kFloat) return w.reshape({N / COLS, COLS, K}).transpose(1, 2).contiguous();
  return w.reshape({N / COLS, COLS, K / 2, 2}).transpose(1, 2).contiguous();
}

}  // namespace tessera_tiles
