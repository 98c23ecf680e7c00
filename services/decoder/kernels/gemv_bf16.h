// The few-row matmul's loops for bf16 x over bf16 weights with the CPU's bf16 dot product (avx512_bf16):
// y[m, n] = sum_k x[m, k] * w[n, k] in fp32 (+ bias[n]). 32 products per instruction against three
// widening ops per 16 in gemv.h's row1, so the loop can keep up with memory. Products of two bf16 are
// exact in fp32 either way; only the order of the fp32 sums differs (and, as the instruction does,
// subnormal inputs and sums count as zero).
//
// Two loops compute it, and which one streams the weights faster depends on the CPU, so the plan times
// both at load at the model's shapes (services/decoder/model/linear.py, choose_bf16_row; pinned by
// --fast-paths gemv_bf16_row=rowwise|interleave4):
// - rowwise (Bf16Row::rowwise): one weight row at a time, read front to back, against every row of x,
//   four accumulators per row of x (row1_dp). On an AMD EPYC Zen 4 (2 threads) a bf16 batch-1 decode
//   of SmolLM2-135M ran at 148.7 tok/s with it and 84.3 with the interleave.
// - interleave4 (Bf16Row::interleave4): one row of x against four weight rows at a time, two
//   accumulators each (rows_dp<4>): eight independent chains whose horizontal sums overlap. On a Zen 5
//   it read a 3072 x 576 weight at 165 GB/s from cache against row1_dp's 157, and a chain of them
//   from memory at 48.9 against 47.8 GB/s. Several rows of x take the four weight rows in turn while
//   they are in L1, so each row's sums are those of its own one-row call.
// Either way a row's sums depend neither on the other rows of x in the call nor on where the threads
// split the weight rows (rows_dp<1> sums a weight row as rows_dp<4> does).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "../../common/kernels/vec.h"

#include <cstdint>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace tessera_gemv {

// The values are gemv_cpu.BF16_ROWS' indices.
enum class Bf16Row : int64_t { rowwise = 0, interleave4 = 1 };

using tessera_vec::PASS_ROWS;

inline Bf16Row bf16_row(int64_t index) {
  TORCH_CHECK(index == 0 || index == 1, "gemv: bf16_row must be 0 (rowwise) or 1 (interleave4), got ", index);
  return static_cast<Bf16Row>(index);
}

#ifdef __AVX512BF16__
constexpr int64_t DP_UNROLL = 4;  // row1_dp's accumulators per row of x

template <int M>
inline void row1_dp(const at::BFloat16* x, const at::BFloat16* wn, int64_t K, int64_t n, float* acc, int64_t N,
                    int64_t ahead) {
  if constexpr (M > PASS_ROWS) {
    row1_dp<PASS_ROWS>(x, wn, K, n, acc, N, ahead);
    row1_dp<M - PASS_ROWS>(x + PASS_ROWS * K, wn, K, n, acc + PASS_ROWS * N, N, 0);
    return;
  }
  __m512 a[M][DP_UNROLL] = {};
  int64_t k = 0;
  // Unrolled by pragma, as gemv.h's row1 (whose four-row call took twice a three-row one without it).
  for (; k + 32 * DP_UNROLL <= K; k += 32 * DP_UNROLL) {
    tessera_vec::prefetch_ahead(wn + k, ahead, 2 * 32 * DP_UNROLL);
    _Pragma("GCC unroll 4") for (int u = 0; u < DP_UNROLL; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + k + 32 * u);
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
        a[m][u] = _mm512_dpbf16_ps(a[m][u], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u), wv);
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wn + k);
    _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
      a[m][0] = _mm512_dpbf16_ps(a[m][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), wv);
  }
  _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
    __m512 sum = a[m][0];
    _Pragma("GCC unroll 4") for (int u = 1; u < DP_UNROLL; ++u) sum = _mm512_add_ps(sum, a[m][u]);
    acc[m * N + n] = _mm512_reduce_add_ps(sum);
  }
}

// acc[n + r] for one row of x against weight rows n .. n + R - 1.
template <int R>
inline void rows_dp(const at::BFloat16* x, const at::BFloat16* wn, int64_t K, int64_t n, float* acc) {
  __m512 a[R][2] = {};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int u = 0; u < 2; ++u) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k + 32 * u);
      for (int r = 0; r < R; ++r)
        a[r][u] = _mm512_dpbf16_ps(a[r][u], xv, (__m512bh)_mm512_loadu_si512(wn + r * K + k + 32 * u));
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k);
    for (int r = 0; r < R; ++r)
      a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, wn + r * K + k));
  }
  for (int r = 0; r < R; ++r) acc[n + r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
}

template <int M>
void run_dp(const at::BFloat16* x, const at::BFloat16* w, const float* bias, float* y, int64_t N, int64_t K,
            Bf16Row loop, int64_t ahead, int64_t streams) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (loop == Bf16Row::interleave4) {
      for (; n + 4 <= n1; n += 4)
        for (int m = 0; m < M; ++m) rows_dp<4>(x + m * K, w + n * K, K, n, y + m * N);
      for (; n < n1; ++n)
        for (int m = 0; m < M; ++m) rows_dp<1>(x + m * K, w + n * K, K, n, y + m * N);
    }
    // rowwise (after interleave4, n is n1 here)
    tessera_vec::each_weight_row(n, n1, streams, [&](int64_t r) { row1_dp<M>(x, w + r * K, K, r, y, N, ahead); });
    if (bias)
      for (int m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
  });
}
#endif

}  // namespace tessera_gemv
