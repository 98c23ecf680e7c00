// Many-row matmul over quantized weights widened in cache: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), w
// either grouped (services/decoder/model/grouped.py: w[n, k] = scale[n, g] * code[n, k] + offset[n, g], g = k / G,
// codes of 4 or 8 bits) or int8 with a scale per output row (services/decoder/model/quantization.py: w[n, k] =
// q[n, k] * scale[n], the scale applied to the row's sums, as its library path does).
//
// Why: a prefill chunk or a decode step of many rows is bound by arithmetic, not by the weight's bytes, so
// the weight is widened to the products' dtype and multiplied there. Widening the whole weight before a library
// matmul writes and reads it again in memory at 2-4 bytes a weight; here each thread widens a block of BLOCK
// weight rows into a buffer that stays in its cache and multiplies every row of x against it. A grouped
// buffer holds exactly what `dequantize` writes (scale * code + offset in fp32, then the products' dtype), an
// int8 one the codes themselves (exact in bf16), so the sums differ from the library's over the same values
// only in their order.
//
// The product is in dot-product form: a tile of up to MR rows of x and NR rows of the buffer keeps MR x NR
// accumulators of 16 fp32 lanes along k (bf16: vdpbf16ps, a pair of products a lane, exact in fp32; fp32:
// FMA), each reduced to its sum once at the end. CPUs with AVX2 and FMA but no AVX-512 multiply in fp32 in
// another form (widen_gemm_avx2.h). x and the buffer are interleaved by vectors of STEP inputs
// (a tile's rows' k-th vectors side by side), so a tile reads both in order: rows of x and of the weight
// 4 KiB apart (K = 2048 in bf16) fell into the same L1 sets and ran the tile at a third of its speed.
// Rows of x past M and buffer rows past N are zeros whose sums are dropped, as are inputs past K.
// A row's sums are the same whatever the other rows of x and the thread count.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "../../common/kernels/bf16.h"
#include "tile_gemm.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TESSERA_WIDEN_AVX2
#endif
#if defined(__AVX512F__) || defined(TESSERA_WIDEN_AVX2)
#define TESSERA_WIDEN
#endif
#ifdef TESSERA_WIDEN_AVX2
#include "widen_gemm_avx2.h"
#endif

namespace tessera_widen {

constexpr int64_t BLOCK = 32;  // weight rows a thread widens at a time (bf16, K = 8192: 512 KiB, in L2)
constexpr int NR = 4;          // buffer rows per tile
constexpr int MR = 6;          // rows of x per tile: 24 accumulators, 4 weight vectors and 1 of x in registers

// Whether this build multiplies in a dtype: fp32 with AVX-512 or AVX2 and FMA, bf16 with the bf16 dot product.
inline bool available(at::ScalarType t) {
#ifdef TESSERA_WIDEN
  return t == at::kBFloat16 ? tessera_tiles::AVAILABLE_BF16 : t == at::kFloat;
#else
  return false;
#endif
}

using tessera_bf16::from_float;
using tessera_bf16::to_bf16_bits;

// Inputs per vector of T (the interleaving's unit): 16 fp32 or 32 bf16.
template <typename T>
constexpr int64_t STEP = std::is_same_v<T, float> ? 16 : 32;

#ifdef __AVX512F__
using tessera_bf16::store16;

// Codes k .. k + 15 of a row (bytes) -> scale * code + offset in fp32 (exact product: a code has at most 8 bits, an
// fp16 scale 11), stored as T into at(k): one vector (a step holds 16 or 32 inputs).
template <typename T, typename At>
inline void widen16(__m128i codes, __m512 s, __m512 o, At at, int64_t k) {
  store16(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), s, o), at(k));
}
#elif defined(TESSERA_WIDEN_AVX2)
// 8 values in fp32 stored as T (bf16: rounded to nearest even, as bf16.h's store16).
template <typename T>
inline void store8(__m256 v, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(dst, v);
  } else {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    // packus pairs 128-bit halves: [r0..3 r0..3 | r4..7 r4..7]; 64-bit elements 0 and 2 are r0..7.
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(p));
  }
}

// Codes k .. k + 15 of a row into at(k) and at(k + 8) (a plain row here: the AVX2 matmul widens into panels).
template <typename T, typename At>
inline void widen16(__m128i codes, __m256 s, __m256 o, At at, int64_t k) {
  store8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), s, o), at(k));
  store8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))), s, o), at(k + 8));
}
#endif

// One weight row (K inputs, groups of G, `bits`-bit codes in grouped.py's layout) dequantized: input k goes to
// dst[(k / STEP) * stride + k % STEP] (stride STEP: a plain row).
template <typename T>
inline void dequantize_row(const uint8_t* wn, const at::Half* sn, const at::Half* on, int64_t K, int64_t G,
                           int64_t bits, T* dst, int64_t stride) {
  constexpr int64_t S = STEP<T>;
  const int64_t gb = G * bits / 8;
  for (int64_t g = 0; g < K / G; ++g) {
    const float s = static_cast<float>(sn[g]), o = static_cast<float>(on[g]);
    const uint8_t* b = wn + g * gb;
    const int64_t k0 = g * G;
    auto at = [&](int64_t i) { return dst + (k0 + i) / S * stride + (k0 + i) % S; };  // i: a multiple of 8
#ifdef TESSERA_WIDEN
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(s), vo = _mm512_set1_ps(o);
#else
    const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
#endif
    const __m128i low = _mm_set1_epi8(0x0F);
    if (bits == 8) {
      for (int64_t i = 0; i < G; i += 16)
        widen16<T>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)), vs, vo, at, i);
    } else if (G == 32) {  // 16 bytes: codes 0..15 in the low nibbles, 16..31 in the high ones
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      widen16<T>(_mm_and_si128(raw, low), vs, vo, at, 0);
      widen16<T>(_mm_and_si128(_mm_srli_epi16(raw, 4), low), vs, vo, at, 16);
    } else {  // G == 16: 8 bytes, codes 0..7 low, 8..15 high
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
      widen16<T>(_mm_unpacklo_epi64(_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low)), vs, vo,
                 at, 0);
    }
#else
    for (int64_t i = 0; i < G; i += 16) {
      T* d = at(i);
      for (int64_t u = 0; u < 16; ++u) {
        const int64_t c = i + u;
        const int code = bits == 8 ? b[c] : (c < G / 2 ? b[c] & 0x0F : b[c - G / 2] >> 4);
        const float v = static_cast<float>(code) * s + o;
        if constexpr (std::is_same_v<T, float>) d[u] = v;
        else d[u] = c10::BFloat16(to_bf16_bits(v), c10::BFloat16::from_bits());
      }
    }
#endif
  }
}

#ifdef __AVX512F__
// The 16-lane sums of four accumulators, lane j of the result a[j]'s: 13 shuffles and adds, where four
// reductions one by one take 32 (with SmolLM2's K = 576 those were a third of a tile's work).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // Within each 128-bit lane: [a0 0+2, a1 0+2, a0 1+3, a1 1+3], the same for a2 and a3, then [a0, a1, a2, a3].
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d01 = _mm512_castps_pd(t01), d23 = _mm512_castps_pd(t23);
  const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Sums [R, NR] of a tile: x's rows and the weight's, interleaved (xt: steps of MR vectors, wt: steps of NR).
template <int R, typename T>
inline void tile(const T* xt, const T* wt, int64_t steps, float (*sums)[NR]) {
  constexpr int64_t S = STEP<T>;
  __m512 acc[R][NR];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const T* w = wt + s * NR * S;
    const T* x = xt + s * MR * S;
    if constexpr (std::is_same_v<T, float>) {
      __m512 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * S);
      for (int m = 0; m < R; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * S);
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    } else {
#ifdef __AVX512BF16__
      __m512bh wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * S);
      for (int m = 0; m < R; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * S);
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
      }
#endif
    }
  }
  static_assert(NR == 4, "sum4 reduces four accumulators");
  for (int m = 0; m < R; ++m) _mm_storeu_ps(sums[m], sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

template <typename T>
inline void tile_rows(int64_t rows, const T* xt, const T* wt, int64_t steps, float (*sums)[NR]) {
  switch (rows) {
    case 1: return tile<1>(xt, wt, steps, sums);
    case 2: return tile<2>(xt, wt, steps, sums);
    case 3: return tile<3>(xt, wt, steps, sums);
    case 4: return tile<4>(xt, wt, steps, sums);
    case 5: return tile<5>(xt, wt, steps, sums);
    default: return tile<MR>(xt, wt, steps, sums);
  }
}
#endif

// A grouped weight as gemm reads it: row n widened into dst (input k at dst[(k / STEP) * stride + k % STEP]);
// its sums need no scale.
struct Grouped {
  const uint8_t* codes;
  const at::Half *scale, *offset;
  int64_t K, G, bits;
  template <typename T>
  void row(int64_t n, T* dst, int64_t stride) const {
    const int64_t ng = K / G;
    dequantize_row(codes + n * (K * bits / 8), scale + n * ng, offset + n * ng, K, G, bits, dst, stride);
  }
  float row_scale(int64_t) const { return 1.f; }
#ifdef TESSERA_WIDEN_AVX2
  // Inputs k0 .. k0 + len - 1 of row n into dst in fp32 (k0 and len multiples of G, which is 16 or 32).
  void part(int64_t n, int64_t k0, int64_t len, float* dst) const {
    const int64_t g0 = k0 >> (G == 32 ? 5 : 4), ng = K >> (G == 32 ? 5 : 4);
    dequantize_row(codes + n * (K * bits / 8) + g0 * (G * bits / 8), scale + n * ng + g0, offset + n * ng + g0, len,
                   G, bits, dst, STEP<float>);  // stride STEP: a plain row
  }
#endif
};

// An int8 weight with a scale per row: the codes widened (exact in bf16 and fp32), the scale on the sums.
struct Int8Rows {
  const int8_t* q;
  const float* scale;
  int64_t K;
  template <typename T>
  void row(int64_t n, T* dst, int64_t stride) const {
    constexpr int64_t S = STEP<T>;
    const int8_t* qn = q + n * K;
    for (int64_t k0 = 0; k0 < K; k0 += S) {
      T* d = dst + k0 / S * stride;
      const int64_t n_in = std::min(S, K - k0);
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= n_in; i += 16)
        store16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + k0 + i)))),
                d + i);
#endif
      for (; i < n_in; ++i) d[i] = from_float<T>(static_cast<float>(qn[k0 + i]));
    }
  }
  float row_scale(int64_t n) const { return scale[n]; }
#ifdef TESSERA_WIDEN_AVX2
  void part(int64_t n, int64_t k0, int64_t len, float* dst) const {  // codes k0 .. k0 + len - 1 of row n (len % 8 == 0)
    for (int64_t i = 0; i < len; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + n * K + k0 + i)))));
  }
#endif
};

// y [M, N] in X = x [M, K] @ w^T (* the rows' scales) (+ bias [N] fp32), X float or BFloat16, w one of the
// sources above, the products in T (X, or BFloat16 for float x: x and the weight rounded to bf16, for the bf16
// dot product's speed); fp32 sums, one rounding to X.
template <typename X, typename T, typename Source>
inline void gemm(const X* x, int64_t M, const Source& w, int64_t N, int64_t K, const float* bias, X* y) {
  TORCH_CHECK(available(c10::CppTypeToScalarType<T>::value), "widen_gemm: this build has no kernel for ",
              c10::CppTypeToScalarType<T>::value, " products");
#ifdef TESSERA_WIDEN_AVX2
  if constexpr (std::is_same_v<X, float> && std::is_same_v<T, float>) tessera_widen_avx2::gemm(x, M, w, N, K, bias, y);
#elif defined(__AVX512F__)
  constexpr int64_t S = STEP<T>;
  const int64_t steps = (K + S - 1) / S, tiles = (M + MR - 1) / MR;
  // x interleaved: tile t, step s, row r of the tile -> xp[((t * steps + s) * MR + r) * S ...], zeros past M and K.
  std::vector<T> xp(tiles * steps * MR * S);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t r = 0; r < MR; ++r) {
          T* d = xp.data() + ((t * steps + s) * MR + r) * S;
          const int64_t m = t * MR + r, n = m < M ? std::min(S, K - s * S) : 0;
          const X* src = x + m * K + s * S;
          if constexpr (std::is_same_v<X, T>) std::memcpy(d, src, n * sizeof(T));
          else for (int64_t i = 0; i < n; ++i) d[i] = from_float<T>(static_cast<float>(src[i]));
          std::fill(d + n, d + S, from_float<T>(0.f));
        }
  });
  at::parallel_for(0, (N + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) {
    // The block interleaved by NR rows: row group q, step s, row j of the group -> buf[((q * steps + s) * NR + j) * S].
    static thread_local std::vector<T> buf;
    buf.resize(BLOCK * steps * S);
    float sums[MR][NR];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK, rows = std::min(BLOCK, N - n0);
      if (rows < BLOCK || K % S) std::fill(buf.begin(), buf.end(), from_float<T>(0.f));
      for (int64_t r = 0; r < rows; ++r) w.row(n0 + r, buf.data() + (r / NR * steps * NR + r % NR) * S, NR * S);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * MR, mr = std::min<int64_t>(MR, M - m0);
        for (int64_t j0 = 0; j0 < rows; j0 += NR) {
          tile_rows(mr, xp.data() + t * steps * MR * S, buf.data() + j0 * steps * S, steps, sums);
          for (int64_t m = 0; m < mr; ++m)
            for (int64_t j = 0; j < NR && j0 + j < rows; ++j) {
              const int64_t n = n0 + j0 + j;
              y[(m0 + m) * N + n] = from_float<X>(sums[m][j] * w.row_scale(n) + (bias ? bias[n] : 0.f));
            }
        }
      }
    }
  });
#endif
}

// out [N, K] in T = the whole weight dequantized (grouped.dequantize's values, rounded once to T).
template <typename T>
inline void dequantize(const uint8_t* codes, const at::Half* scale, const at::Half* offset, int64_t N, int64_t K,
                       int64_t G, int64_t bits, T* out) {
  const int64_t rb = K * bits / 8, ng = K / G;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      dequantize_row(codes + n * rb, scale + n * ng, offset + n * ng, K, G, bits, out + n * K, STEP<T>);
  });
}

}  // namespace tessera_widen
