// Many-row matmul over quantized weights widened in cache, multiplied on the CPU's tile unit (AMX, bf16):
// y[m, n] = sum_k x[m, k] * w[n, k] (* the row's scale) (+ bias[n]), for the weight sources of widen_gemm.h.
//
// Why: on an Intel Xeon with AMX (family 6 model 167, 2 threads) the library's bf16 GEMM runs about 800
// GFLOP/s where the AVX-512 bf16 dot product (widen_gemm.h's tiles) tops out near a fifth of that, so a
// prefill chunk over 4-bit weights ran at the fp32 GEMM's speed, 5-7x behind the same model in bf16. Here
// each thread widens a block of weight rows to bf16 in a buffer that stays in its cache, exactly as
// widen_gemm.h does, and multiplies it against x on the tile unit: the weight is the tile product's A
// (16 rows of 32 inputs, the rows as widened), x its B (16 rows of x, pairs of inputs side by side: the
// layout the tile product reads), the sums a 16 x 16 fp32 tile per pair. Products of bf16 are exact in fp32;
// the sums are fp32 in the unit's order, so they differ from widen_gemm.h's only in that order. A row's sums
// are the same whatever the other rows of x and the thread count (a tile's rows never mix).
#pragma once

#include "widen_gemm.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace tessera_amx {

using tessera_widen::from_float;

constexpr int64_t TR = 16;     // rows of a tile (weight rows of an A tile, x rows of a B tile)
constexpr int64_t TK = 32;     // bf16 inputs per tile row (64 bytes)
constexpr int64_t TILE = TR * TK;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool BUILT = true;
#else
constexpr bool BUILT = false;
#endif

// Whether the tile unit runs here: built for it, and Linux lets this process use its state (asked once; the
// permission holds for every thread of the process).
inline bool available() {
  static const bool ok = [] {
    if (!BUILT) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Weight rows a thread widens at a time: whole pairs of A tiles, at most WIDE_BYTES of bf16, and few enough
// that every thread gets at least 4 blocks (SmolLM2's 576-row projections would otherwise split 3:2).
constexpr int64_t WIDE_BYTES = 256 << 10;
inline int64_t block_rows(int64_t N, int64_t K, int64_t threads) {
  int64_t b = std::clamp<int64_t>(WIDE_BYTES / (2 * K) / (2 * TR) * (2 * TR), 2 * TR, 8 * TR);
  while (b > 2 * TR && (N + b - 1) / b < 4 * threads) b -= 2 * TR;
  return b;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 the sums (weight sub-block a, x tile b -> 2a + b), 4-5 the weight (A), 6-7 x (B); all 16 x 64 bytes.
inline void configure() {
  Config c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = TK * 2, c.rows[t] = TR;
  _tile_loadconfig(&c);
}

// sums[2a + b] [16 weight rows][16 x rows] = weight sub-blocks wa[0..1] against x tiles xb[0..XT-1], over
// `steps` steps of 32 inputs (each operand a 16 x 32 tile per step, 1 KiB apart).
template <int XT>
inline void tiles(const at::BFloat16* w0, const at::BFloat16* w1, const at::BFloat16* x0, const at::BFloat16* x1,
                  int64_t steps, float (*sums)[TR][TR]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, w0 + s * TILE, TK * 2);
    _tile_loadd(5, w1 + s * TILE, TK * 2);
    _tile_loadd(6, x0 + s * TILE, TK * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (XT == 2) {
      _tile_loadd(7, x1 + s * TILE, TK * 2);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], TR * 4);
  _tile_stored(2, sums[2], TR * 4);
  if constexpr (XT == 2) {
    _tile_stored(1, sums[1], TR * 4);
    _tile_stored(3, sums[3], TR * 4);
  }
}
#endif

// y [M, N] in X = x [M, K] @ w^T (* the rows' scales) (+ bias [N] fp32), X float or BFloat16, w a widen_gemm.h
// source, the products in bf16 on the tile unit; fp32 sums, one rounding to X.
template <typename X, typename Source>
inline void gemm(const X* x, int64_t M, const Source& w, int64_t N, int64_t K, const float* bias, X* y) {
  TORCH_CHECK(available(), "amx_gemm: this CPU, build or kernel does not run the tile unit (AMX bf16)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  using T = at::BFloat16;
  const int64_t steps = (K + TK - 1) / TK, xtiles = (M + TR - 1) / TR;
  // x in pairs: tile t, step s, pair p, row r -> xp[(t * steps + s) * TILE + p * 2 * TR + 2 * r + (0|1)] =
  // x[16 t + r, 32 s + 2 p + (0|1)]; zeros past M and K.
  std::vector<T> xp(xtiles * steps * TILE);
  at::parallel_for(0, xtiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < TR; ++r) {
        const int64_t m = t * TR + r;
        const X* src = x + m * K;
        for (int64_t s = 0; s < steps; ++s) {
          T* d = xp.data() + (t * steps + s) * TILE + 2 * r;
          for (int64_t i = 0; i < TK; ++i) {
            const int64_t k = s * TK + i;
            d[i / 2 * 2 * TR + i % 2] = m < M && k < K ? from_float<T>(static_cast<float>(src[k])) : from_float<T>(0.f);
          }
        }
      }
  });
  const int64_t B = block_rows(N, K, at::get_num_threads());
  at::parallel_for(0, (N + B - 1) / B, 1, [&](int64_t b0, int64_t b1) {
    // The block as A tiles: sub-block q, step s, row r -> buf[(q * steps + s) * TILE + r * TK ...].
    static thread_local std::vector<T> buf;
    buf.resize(B * steps * TK);
    alignas(64) float sums[4][TR][TR];
    configure();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * B, rows = std::min(B, N - n0);
      if (rows < B || K % TK) std::fill(buf.begin(), buf.end(), from_float<T>(0.f));
      for (int64_t r = 0; r < rows; ++r) w.row(n0 + r, buf.data() + (r / TR * steps * TR + r % TR) * TK, TILE);
      for (int64_t t = 0; t < xtiles; t += 2) {
        const int64_t xt = std::min<int64_t>(2, xtiles - t);
        const T* x0 = xp.data() + t * steps * TILE;
        for (int64_t q = 0; q * TR < rows; q += 2) {
          const T* w0 = buf.data() + q * steps * TILE;
          if (xt == 2) tiles<2>(w0, w0 + steps * TILE, x0, x0 + steps * TILE, steps, sums);
          else tiles<1>(w0, w0 + steps * TILE, x0, nullptr, steps, sums);
          for (int64_t a = 0; a < 2; ++a)
            for (int64_t j = 0; j < TR; ++j) {
              const int64_t n = n0 + (q + a) * TR + j;
              if (n >= n0 + rows) break;
              const float scale = w.row_scale(n), add = bias ? bias[n] : 0.f;
              for (int64_t c = 0; c < xt; ++c)
                for (int64_t i = 0; i < TR; ++i) {
                  const int64_t m = (t + c) * TR + i;
                  if (m < M) y[m * N + n] = from_float<X>(sums[2 * a + c][j][i] * scale + add);
                }
            }
        }
      }
    }
    _tile_release();
  });
#endif
}

}  // namespace tessera_amx
