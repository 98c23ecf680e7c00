// Few-row matmul for decode on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (* scale[n]) (+ bias[n]).
//
// At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
// weights once; the library GEMMs are tuned for many rows and read the weights at about half
// the rate the machine streams them. This loop streams each weight row once for all
// M <= MAX_ROWS rows of x: x stays in L1, each row of x has independent accumulators (so the FMA
// latency is hidden), rows past PASS_ROWS take the weight row again from L1 (vec.h), and the weight rows
// are split over the threads.
// Weights are float32 or bfloat16 (widened exactly to fp32), x is fp32 and the sums are fp32; or int8
// with one fp32 scale per row (model/quantization.py), for which x is rounded to int8 in blocks of
// QBLOCK inputs and the products summed in int32 (see dispatch_q8).
// On AVX-512 CPUs (-march=native defines __AVX512F__) and on AVX2+FMA ones (Zen 3, older Xeons) the
// loop is written with intrinsics; elsewhere a portable `#pragma omp simd` loop does the same sums.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gemv_bf16.h"
#include "quant_row.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace tessera_gemv {

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int64_t NB = 4;        // weight rows reduced together
using tessera_vec::MAX_ROWS;  // rows of x per call (gemv_cpu.MAX_ROWS), PASS_ROWS of them a pass

template <typename F>
inline void with_rows(int64_t M, F&& f) { tessera_vec::with_rows(M, "gemv", f); }

#if defined(__AVX2__) && defined(__FMA__)
// The sum of 8 lanes (the AVX2 loops', and the int8 one's on AVX-512 CPUs without VNNI).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef __AVX512F__
#define TESSERA_GEMV_ROW1 1
// 16 weights widened to fp32 (lanes past `mask` read as zero and are never loaded).
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {
  __m256i raw = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// acc[m, n] for M rows of x over weight row n, explicit AVX-512: the compiler's vectorisation of the
// portable loop below reached only ~30 GB/s of weights where the machine streams >100 GB/s. One
// weight row at a time, read front to back (the hardware prefetcher follows one stream), with
// UNROLL independent accumulators per row of x to hide the FMA latency.
constexpr int64_t UNROLL = 4;

// acc[m, n] = the sum of row m's UNROLL accumulators.
template <int M>
inline void store_sums(__m512 (&a)[M][UNROLL], float* acc, int64_t n, int64_t N) {
  _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
    __m512 sum = a[m][0];
    _Pragma("GCC unroll 4") for (int u = 1; u < UNROLL; ++u) sum = _mm512_add_ps(sum, a[m][u]);
    acc[m * N + n] = _mm512_reduce_add_ps(sum);
  }
}

template <typename W, int M>
inline void row1(const float* x, const W* wn, int64_t K, int64_t n, float* acc, int64_t N, int64_t ahead) {
  if constexpr (M > PASS_ROWS) {
    row1<W, PASS_ROWS>(x, wn, K, n, acc, N, ahead);
    row1<W, M - PASS_ROWS>(x + PASS_ROWS * K, wn, K, n, acc + PASS_ROWS * N, N, 0);  // the row is in L1 by now
    return;
  }
  __m512 a[M][UNROLL] = {};
  int64_t k = 0;
  // Unrolled by pragma, as lora_rows.h's loops: without it a four-row call (16 accumulators) took twice a
  // three-row one on an Intel Xeon (family 6 model 106, GCC 12).
  for (; k + 16 * UNROLL <= K; k += 16 * UNROLL) {
    tessera_vec::prefetch_ahead(wn + k, ahead, sizeof(W) * 16 * UNROLL);
    _Pragma("GCC unroll 4") for (int u = 0; u < UNROLL; ++u) {
      const __m512 wv = load16(wn + k + 16 * u, static_cast<__mmask16>(0xFFFF));
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
        a[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wv, a[m][u]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 wv = load16(wn + k, mask);
    _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
      a[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k), wv, a[m][0]);
  }
  store_sums<M>(a, acc, n, N);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define TESSERA_GEMV_ROW1 1
// The same loop in 8 lanes for CPUs without AVX-512: on Zen 3 the portable loop's vectorisation
// read the weights at well under the rate the machine streams them, as it did on AVX-512.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <typename W, int M>
inline void row1(const float* x, const W* wn, int64_t K, int64_t n, float* acc, int64_t N, int64_t ahead) {
  // 16 ymm registers hold at most two rows' U = 4 accumulators; rows 3 and 4 take a second pass over
  // the weight row, from L1. U is the same for every M, so a row's sums do not depend on how many
  // rows share the call (the decode stack's batch invariance).
  constexpr int U = 4;
  if constexpr (M > 2) {
    row1<W, 2>(x, wn, K, n, acc, N, ahead);
    row1<W, M - 2>(x + 2 * K, wn, K, n, acc + 2 * N, N, 0);   // the row is in L1 by now
    return;
  }
  __m256 a[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) a[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    tessera_vec::prefetch_ahead(wn + k, ahead, sizeof(W) * 8 * U);
    for (int u = 0; u < U; ++u) {
      const __m256 wv = load8(wn + k + 8 * u);
      for (int m = 0; m < M; ++m) a[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * u), wv, a[m][u]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = load8(wn + k);
    for (int m = 0; m < M; ++m) a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, a[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    __m256 sum = a[m][0];
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, a[m][u]);
    float s = hsum(sum);
    // std::fma, not `s += x * w`: GCC contracted that to an FMA in some inlined copies of this loop and not in
    // others (a Zen 3 build's two-stream reading summed rows 3-4 of a 4-row call differently from one stream).
    for (int64_t j = k; j < K; ++j) s = std::fma(x[m * K + j], widen(wn[j]), s);
    acc[m * N + n] = s;
  }
}
#endif

template <typename W, int M>
void rows_block(const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, float* acc /* [M, N] */,
                int64_t N, int64_t ahead, int64_t streams) {
  int64_t n = n0;
#ifdef TESSERA_GEMV_ROW1
  tessera_vec::each_weight_row(n0, n1, streams, [&](int64_t r) { row1<W, M>(x, w + r * K, K, r, acc, N, ahead); });
  n = n1;
#endif
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

// int8 weights: each row of x rounded by quant_row.h's quantize_row, its blocks' products summed in int32.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// One QCHUNK step of row_q8: a += s * (q . w) over inputs [k, k + QCHUNK) of every row.
template <int M>
inline void step_q8(__m512 (&a)[M], const int8_t* const (&q)[M], const int32_t* const (&c)[M],
                    const float* const (&s)[M], __m512i wu, int64_t k) {
  for (int m = 0; m < M; ++m) {
    const __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(c[m] + k / 4), wu, _mm512_loadu_si512(q[m] + k));
    a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(s[m] + k / 4), a[m]);
  }
}

// acc[m, n] = sum over blocks of s * (q . w) for M rows. The dot-product instruction multiplies unsigned
// by signed bytes: the weights are flipped to unsigned (w + 128, an XOR of the sign bit) and each
// lane starts at -128 * (its four q), so every lane ends at the exact signed sum.
template <int M>
inline void row_q8(const QuantRow* xr, const int8_t* wn, int64_t K, int64_t n, float* acc, int64_t N,
                   int64_t ahead) {
  if constexpr (M > PASS_ROWS) {
    row_q8<PASS_ROWS>(xr, wn, K, n, acc, N, ahead);
    row_q8<M - PASS_ROWS>(xr + PASS_ROWS, wn, K, n, acc + PASS_ROWS * N, N, 0);
    return;
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* q[M];
  const int32_t* c[M];
  const float* s[M];
  for (int m = 0; m < M; ++m) {
    q[m] = xr[m].q.data();
    c[m] = xr[m].corr.data();
    s[m] = xr[m].s.data();
  }
  __m512 a0[M] = {}, a1[M] = {};  // two chains, so one chunk's FMA need not wait for the last's
  int64_t k = 0;
  for (; k + 2 * QCHUNK <= K; k += 2 * QCHUNK) {
    tessera_vec::prefetch_ahead(wn + k, ahead, 2 * QCHUNK);
    step_q8<M>(a0, q, c, s, _mm512_xor_si512(_mm512_loadu_si512(wn + k), flip), k);
    step_q8<M>(a1, q, c, s, _mm512_xor_si512(_mm512_loadu_si512(wn + k + QCHUNK), flip), k + QCHUNK);
  }
  for (; k < K; k += QCHUNK) {  // the rest, the last chunk masked (x is zero past K)
    const __mmask64 mask = K - k >= QCHUNK ? ~__mmask64{0} : (__mmask64{1} << (K - k)) - 1;
    step_q8<M>(a0, q, c, s, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wn + k), flip), k);
  }
  for (int m = 0; m < M; ++m) acc[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}
#elif defined(__AVX2__) && defined(__FMA__)
// One QBLOCK step of row_q8 without the int8 dot-product instruction (Zen 2, Zen 3, pre-VNNI Xeons): the
// multiply-add of unsigned by signed bytes into int16 pairs takes |w| (the sign moved onto q), so each pair
// is at most 2 * 128 * 127 < 2^15 and never saturates; pairs then summed into int32 lanes of 4 products.
template <int M>
inline void step_q8(__m256 (&a)[M], const int8_t* const (&q)[M], const float* const (&s)[M], __m256i w, int64_t k) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i wabs = _mm256_sign_epi8(w, w);  // -128 stays 0x80: 128 read as unsigned
  for (int m = 0; m < M; ++m) {
    const __m256i qs = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[m] + k)), w);
    const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, qs), ones);
    a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(s[m] + k / 4), a[m]);
  }
}

// acc[m, n] = sum over blocks of s * (q . w) for M rows, one 32-byte block per step (QBLOCK = 32); x's
// rows are zero past K up to a whole QCHUNK, so the tail block reads zeros times whatever w holds there,
// except that w past K must not be read: the last partial block is copied into a zeroed buffer first.
template <int M>
inline void row_q8(const QuantRow* xr, const int8_t* wn, int64_t K, int64_t n, float* acc, int64_t N,
                   int64_t ahead) {
  if constexpr (M > PASS_ROWS) {
    row_q8<PASS_ROWS>(xr, wn, K, n, acc, N, ahead);
    row_q8<M - PASS_ROWS>(xr + PASS_ROWS, wn, K, n, acc + PASS_ROWS * N, N, 0);
    return;
  }
  const int8_t* q[M];
  const float* s[M];
  for (int m = 0; m < M; ++m) {
    q[m] = xr[m].q.data();
    s[m] = xr[m].s.data();
  }
  __m256 a0[M], a1[M];  // two chains, so one block's FMA need not wait for the last's
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * QBLOCK <= K; k += 2 * QBLOCK) {
    tessera_vec::prefetch_ahead(wn + k, ahead, 2 * QBLOCK);
    step_q8<M>(a0, q, s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + k)), k);
    step_q8<M>(a1, q, s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + k + QBLOCK)), k + QBLOCK);
  }
  for (; k < K; k += QBLOCK) {
    alignas(32) int8_t tail[QBLOCK] = {};
    std::memcpy(tail, wn + k, std::min(QBLOCK, K - k));
    step_q8<M>(a0, q, s, _mm256_load_si256(reinterpret_cast<const __m256i*>(tail)), k);
  }
  for (int m = 0; m < M; ++m) acc[m * N + n] = hsum(_mm256_add_ps(a0[m], a1[m]));
}
#else
template <int M>
inline void row_q8(const QuantRow* xr, const int8_t* wn, int64_t K, int64_t n, float* acc, int64_t N, int64_t) {
  for (int m = 0; m < M; ++m) {
    const int8_t* q = xr[m].q.data();
    float total = 0.0f;
    for (int64_t b0 = 0; b0 < K; b0 += QBLOCK) {
      const int64_t len = std::min(QBLOCK, K - b0);
      int32_t d = 0;
#pragma omp simd reduction(+ : d)
      for (int64_t i = 0; i < len; ++i) d += static_cast<int32_t>(q[b0 + i]) * wn[b0 + i];
      total += xr[m].s[b0 / 4] * static_cast<float>(d);
    }
    acc[m * N + n] = total;
  }
}
#endif

template <int M>
void run_q8(const float* x, const int8_t* w, const float* scale, const float* bias, float* y, int64_t N,
            int64_t K, int64_t ahead, int64_t streams) {
  // The caller's thread's buffers, kept between calls (no allocation per projection); the workers
  // read them through this pointer (their own thread_local would be another, empty one).
  static thread_local QuantRow mine[MAX_ROWS];
  const QuantRow* xr = mine;
  for (int m = 0; m < M; ++m) quantize_row(x + m * K, K, mine[m]);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    tessera_vec::each_weight_row(n0, n1, streams, [&](int64_t n) { row_q8<M>(xr, w + n * K, K, n, y, N, ahead); });
    for (int m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] = y[m * N + n] * scale[n] + (bias ? bias[n] : 0.0f);
  });
}

// y [M, N] fp32 = (x [M, K] fp32 rounded as gemv_cpu.round_blocks) @ w [N, K] int8 ^T * scale [N] (+ bias).
void dispatch_q8(int64_t M, const float* x, const int8_t* w, const float* scale, const float* bias, float* y,
                 int64_t N, int64_t K, int64_t ahead, int64_t streams) {
  with_rows(M, [&](auto R) { run_q8<R.value>(x, w, scale, bias, y, N, K, ahead, streams); });
}

template <typename W, int M>
void run(const float* x, const W* w, const float* bias, float* y, int64_t N, int64_t K, int64_t ahead,
         int64_t streams) {
  // Blocks of weight rows per task: whole NB groups, at least 64 rows so a task is worth starting.
  const int64_t grain = 64;
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    rows_block<W, M>(x, w, K, n0, n1, y, N, ahead, streams);
    for (int m = 0; m < M; ++m) {
      float* ym = y + m * N;
      if (bias)
        for (int64_t n = n0; n < n1; ++n) ym[n] += bias[n];
    }
  });
}

// ahead: tessera_vec::prefetch_ahead's distance in bytes (0: none); streams: tessera_vec::each_weight_row's.
template <typename W>
void dispatch_rows(int64_t M, const float* x, const W* w, const float* bias, float* y, int64_t N, int64_t K,
                   int64_t ahead, int64_t streams) {
  with_rows(M, [&](auto R) { run<W, R.value>(x, w, bias, y, N, K, ahead, streams); });
}

// y [M, N] fp32 = x [M, K] bf16 @ w [N, K] bf16 ^T (+ bias): the dot-product instruction where the CPU
// has it, by `loop` (gemv_bf16.h), else x widened once and the fp32 loop (the same for either loop).
void dispatch_bf16(int64_t M, const at::BFloat16* x, const at::BFloat16* w, const float* bias, float* y, int64_t N,
                   int64_t K, Bf16Row loop, int64_t ahead, int64_t streams) {
#ifdef __AVX512BF16__
  with_rows(M, [&](auto R) { run_dp<R.value>(x, w, bias, y, N, K, loop, ahead, streams); });
#else
  std::vector<float> xs(M * K);
  for (int64_t i = 0; i < M * K; ++i) xs[i] = widen(x[i]);
  dispatch_rows(M, xs.data(), w, bias, y, N, K, ahead, streams);
#endif
}

// out [M, N] = x [M, K] @ w[N, K]^T (* scale [N] fp32) (+ bias [N] fp32); all contiguous. x and out
// are both float32 or both bfloat16: bf16 x is widened once into fp32 and the fp32 result rounded
// once into out (round to nearest even), here rather than by two more torch ops per call.
// bf16_row: gemv_bf16.h's loop for bf16 x over bf16 weights (Bf16Row's value); ahead: tessera_vec::prefetch_ahead's
// distance in bytes (0: none); streams: 1 or 2, tessera_vec::each_weight_row's.
void gemv(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
          c10::optional<torch::Tensor> bias, int64_t bf16_row, int64_t ahead, int64_t streams) {
  TORCH_CHECK(ahead >= 0, "gemv: ahead must be >= 0, got ", ahead);
  TORCH_CHECK(streams == 1 || streams == 2, "gemv: streams must be 1 or 2, got ", streams);
  const Bf16Row loop = tessera_gemv::bf16_row(bf16_row);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "gemv: x, w and out must be 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "gemv: w is [", N, ", ", w.size(1), "] but x has ", K, " columns");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "gemv: out must be [", M, ", ", N, "]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && out.scalar_type() == x.scalar_type(),
              "gemv: x and out must both be float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "gemv: tensors must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "gemv: CPU tensors only");
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "gemv: at most ", MAX_ROWS, " rows, got ", M);
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
  std::vector<float> xs, ys;
  const float* xp;
  float* yp;
  if (bf16) {
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    xs.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xs[i] = widen(xb[i]);
    ys.resize(M * N);
    xp = xs.data();
    yp = ys.data();
  } else {
    xp = x.data_ptr<float>();
    yp = out.data_ptr<float>();
  }
  switch (w.scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(!sp, "gemv: scale is for int8 weights");
      dispatch_rows(M, xp, w.data_ptr<float>(), bp, yp, N, K, ahead, streams);
      break;
    case at::kBFloat16:
      TORCH_CHECK(!sp, "gemv: scale is for int8 weights");
      if (bf16) {
        dispatch_bf16(M, x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), bp, yp, N, K, loop, ahead, streams);
      } else {
        dispatch_rows(M, xp, w.data_ptr<at::BFloat16>(), bp, yp, N, K, ahead, streams);
      }
      break;
    case at::kChar:
      TORCH_CHECK(sp, "gemv: int8 weights need a scale");
      dispatch_q8(M, xp, w.data_ptr<int8_t>(), sp, bp, yp, N, K, ahead, streams);
      break;
    default:
      TORCH_CHECK(false, "gemv: weights must be float32, bfloat16 or int8, got ", w.scalar_type());
  }
  if (bf16) {
    at::BFloat16* ob = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) ob[i] = at::BFloat16(ys[i]);
  }
}

}  // namespace tessera_gemv
