// widen_gemm.h's many-row matmul on CPUs with AVX2 and FMA but no AVX-512 (Zen 2, Zen 3, older Xeons):
// y[m, n] = sum_k x[m, k] * w[n, k] in fp32, w widened from its codes (Source::part) into panels in cache.
//
// Why not widen_gemm.h's dot-product form: with 16 vector registers its tile is 3 rows of x by 4 weight rows,
// 7 loads for 12 FMAs, and a Zen 3 ran it at half the library's fp32 GFLOP/s. Here the product is in
// outer-product form, as the BLAS kernels are: a panel holds PANEL weight rows transposed (input k's 16 weights
// side by side), widened KC inputs at a time and transposed 8 x 8 in registers (widen_panel); a tile of up to
// PR rows of x keeps PR x 2 vectors of sums, each input of x broadcast once against the panel's two vectors:
// 12 FMAs for 2 loads and 6 broadcasts. Every sum is one FMA chain over k = 0 .. K - 1 in order, so a row's
// result is the same whatever the other rows of x, the tiles and the thread count.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <immintrin.h>

namespace tessera_widen_avx2 {

constexpr int64_t PANEL = 16;  // weight rows per panel: two 8-lane vectors of sums per row of x
constexpr int PR = 6;          // rows of x per tile: 12 sums, 2 panel vectors and 1 broadcast in registers
constexpr int64_t KC = 128;    // inputs of a panel widened at a time (a multiple of every group size)

// Rows r[0..7] (8 inputs each) -> dst + j * ds for input j = 0..7 (8 rows side by side).
inline void transpose_store(const __m256 (&r)[8], float* dst, int64_t ds) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // t[2i] = [a0 b0 a1 b1 | a4 b4 a5 b5], t[2i+1] = [a2 b2 a3 b3 | a6 b6 a7 b7]
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + j]: input j | j + 4 of rows 4i .. 4i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ds, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ds, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
  }
}

// Weight rows n0 .. n0 + rows - 1 (rows <= PANEL) as a panel: input k's weights at panel[k * PANEL ..], zeros
// for rows past `rows`. KC inputs of each row at a time are widened in a row-major scratch in L1 (Source::part,
// the codes' own vector loop, a group's scale and offset taken once) and transposed from there.
template <typename Source>
inline void widen_panel(const Source& w, int64_t n0, int64_t rows, int64_t K, float* panel) {
  alignas(32) static thread_local float scratch[PANEL * KC];
  std::fill(scratch + rows * KC, scratch + PANEL * KC, 0.f);
  __m256 r[8];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t len = std::min(KC, K - k0);
    for (int64_t i = 0; i < rows; ++i) w.part(n0 + i, k0, len, scratch + i * KC);
    for (int64_t k = 0; k < len; k += 8)
      for (int64_t h = 0; h < PANEL; h += 8) {
        for (int64_t i = 0; i < 8; ++i) r[i] = _mm256_load_ps(scratch + (h + i) * KC + k);
        transpose_store(r, panel + (k0 + k) * PANEL + h, PANEL);
      }
  }
}

// Sums [R, PANEL] of x's rows (x, row stride K) against a panel, as one FMA chain per sum over k.
template <int R>
inline void tile(const float* x, int64_t K, const float* panel, __m256 (&out)[PR][2]) {
  __m256 acc[R][2];  // local, so that the compiler keeps them in registers
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * PANEL), b1 = _mm256_loadu_ps(panel + k * PANEL + 8);
    for (int m = 0; m < R; ++m) {
      const __m256 a = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(a, b1, acc[m][1]);
    }
  }
  for (int m = 0; m < R; ++m) out[m][0] = acc[m][0], out[m][1] = acc[m][1];
}

template <int R = 1>
inline void tile_rows(int64_t rows, const float* x, int64_t K, const float* panel, __m256 (&acc)[PR][2]) {
  if constexpr (R < PR) {
    if (rows != R) return tile_rows<R + 1>(rows, x, K, panel, acc);
  }
  tile<R>(x, K, panel, acc);
}

// y [M, N] = x [M, K] @ w^T times the rows' scales (+ bias [N]), fp32 throughout; K a multiple of 16
// (every int8 and grouped weight's: quantization.K_MULTIPLE, the groups).
template <typename Source>
inline void gemm(const float* x, int64_t M, const Source& w, int64_t N, int64_t K, const float* bias, float* y) {
  TORCH_CHECK(K % 16 == 0, "widen_gemm: the AVX2 kernel takes K a multiple of 16, got ", K);
  at::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t p0, int64_t p1) {
    static thread_local std::vector<float> panel;
    panel.resize(K * PANEL);
    __m256 acc[PR][2];
    alignas(32) float scale[PANEL], add[PANEL], row[PANEL];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, N - n0);
      widen_panel(w, n0, cols, K, panel.data());
      for (int64_t j = 0; j < PANEL; ++j) {
        scale[j] = j < cols ? w.row_scale(n0 + j) : 0.f;
        add[j] = j < cols && bias ? bias[n0 + j] : 0.f;
      }
      const __m256 s0 = _mm256_load_ps(scale), s1 = _mm256_load_ps(scale + 8);
      const __m256 a0 = _mm256_load_ps(add), a1 = _mm256_load_ps(add + 8);
      for (int64_t m0 = 0; m0 < M; m0 += PR) {
        const int64_t R = std::min<int64_t>(PR, M - m0);
        tile_rows(R, x + m0 * K, K, panel.data(), acc);
        for (int64_t m = 0; m < R; ++m) {
          const __m256 v0 = _mm256_fmadd_ps(acc[m][0], s0, a0), v1 = _mm256_fmadd_ps(acc[m][1], s1, a1);
          float* out = y + (m0 + m) * N + n0;
          if (cols == PANEL) {
            _mm256_storeu_ps(out, v0);
            _mm256_storeu_ps(out + 8, v1);
          } else {
            _mm256_store_ps(row, v0);
            _mm256_store_ps(row + 8, v1);
            std::copy(row, row + cols, out);
          }
        }
      }
    }
  });
}

}  // namespace tessera_widen_avx2
