// Many-row matmuls on the CPU's tile unit (AMX, bf16): y[m, n] = sum_k x[m, k] * w[n, k] (* the row's scale)
// (+ bias[n]), for the decoder's quantized weight sources (services/decoder/kernels/widen_gemm.h: `gemm`), for a
// bf16 weight laid out once as panels (`gemm_packed`), and for an fp32 weight split in bf16 halves (`gemm_split`).
//
// Why: on an Intel Xeon with AMX (family 6 model 167, 2 threads) the library's dense bf16 GEMM runs 1.2-2
// TFLOP/s at 256-512 rows, where the AVX-512 bf16 dot product (widen_gemm.h's tiles) tops out near 200
// GFLOP/s, so a prefill chunk over 4-bit weights ran 5-7x behind the same model in bf16. Here each thread
// widens a block of weight rows to bf16 in a buffer that stays in its cache, as widen_gemm.h does, and
// multiplies it against x on the tile unit: x is the tile product's A (16 rows of 32 inputs), the weight its
// B (16 weight rows' pairs of inputs side by side, the layout the tile product reads: each widened 16 x 32
// block transposed by pairs), the sums a 16 x 16 fp32 tile of y, written out a row of y at a time. (The
// other way round, the weight as A, x as B, left a column of y per tile row; writing those one by one took
// three quarters of the time.) Products of bf16 are exact in fp32; the sums are fp32 in the unit's order, so
// they differ from widen_gemm.h's only in that order. A row's sums are the same whatever the other rows of x
// and the thread count (a tile's rows never mix).
//
// Split products: fp32 x and w each as hi + lo, hi = bf16(v) and lo = bf16(v - hi), every product as
// hi hi + lo hi + hi lo, three tile products into the same fp32 sums (lo lo, below 2^-17 of |x w|, left out):
// fp32 to about 16 bits per operand, torch's float32 matmul precision "high". On an Intel Xeon with AMX (family
// 6 model 207) 2.0-2.7x oneDNN's fp32 matmul over 97-512 rows of SmolLM2's and MiniLM's shapes.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"

namespace tessera_amx {

using tessera_bf16::from_float;

constexpr int64_t TR = 16;     // rows of a tile (x rows of an A tile, input pairs of a B tile)
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

// p rounded up to a cache line (a vector of bf16 with TK spare elements holds its size from there).
template <typename T>
inline T* aligned(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
using tessera_bf16::store16;  // bf16.h has it with AVX-512 only, which every AMX CPU has

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 the sums (x tile a, weight sub-block b -> 2a + b), 4-5 x (A), 6-7 the weight (B); all 16 x 64 bytes.
inline void configure() {
  Config c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = TK * 2, c.rows[t] = TR;
  _tile_loadconfig(&c);
}

// The 16 x 16 dwords at p (rows 64 bytes apart) transposed in place: a tile of 16 weight rows of 32 inputs
// becomes the tile product's B, row p holding input pair p of each weight row.
inline void transpose16(void* p) {
  __m512i r[16], t[16];
  auto* v = static_cast<__m512i*>(p);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(v + i);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // Per 128-bit lane L, r[4i + j] then holds rows 4i..4i+3 of column 4L + j.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    _mm512_store_si512(v + i, _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88));
    _mm512_store_si512(v + 4 + i, _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88));
    _mm512_store_si512(v + 8 + i, _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd));
    _mm512_store_si512(v + 12 + i, _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd));
  }
}

// A step's operands: x tiles x0, x1 (A) and weight sub-blocks w0, w1 (B); where the products are split (fp32 as
// two bf16, hi + lo), the lo halves x0l, x1l, w0l, w1l too.
struct Operands {
  const at::BFloat16 *x0, *x1, *w0, *w1;
  const at::BFloat16 *x0l = nullptr, *x1l = nullptr, *w0l = nullptr, *w1l = nullptr;
};

// sums[2a + b] [16 x rows][16 weight rows] += x tile a (of XT) against weight sub-block b, the tiles s * TILE into
// each operand: `x` and `w` one pair of operands.
template <int XT>
inline void step_products(const at::BFloat16* x0, const at::BFloat16* x1, const at::BFloat16* w0,
                          const at::BFloat16* w1, int64_t s) {
  _tile_loadd(6, w0 + s * TILE, TK * 2);
  _tile_loadd(7, w1 + s * TILE, TK * 2);
  _tile_loadd(4, x0 + s * TILE, TK * 2);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if constexpr (XT == 2) {
    _tile_loadd(5, x1 + s * TILE, TK * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// sums[2a + b] = x tiles against weight sub-blocks over `steps` steps of 32 inputs (each operand a 16 x 32 tile
// per step, 1 KiB apart). SPLIT: x w as hi hi + lo hi + hi lo, each step (lo lo, below the sum's own rounding,
// left out).
template <int XT, bool SPLIT>
inline void tiles(const Operands& o, int64_t steps, float (*sums)[TR][TR]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    if constexpr (SPLIT) {
      step_products<XT>(o.x0l, o.x1l, o.w0, o.w1, s);
      step_products<XT>(o.x0, o.x1, o.w0l, o.w1l, s);
    }
    step_products<XT>(o.x0, o.x1, o.w0, o.w1, s);
  }
  _tile_stored(0, sums[0], TR * 4);
  _tile_stored(1, sums[1], TR * 4);
  if constexpr (XT == 2) {
    _tile_stored(2, sums[2], TR * 4);
    _tile_stored(3, sums[3], TR * 4);
  }
}

// v - bf16(v): what rounding v to bf16 leaves (exact in fp32), the lo half of a split.
inline __m512 residue(__m512 v) {
  alignas(32) at::BFloat16 hi[16];
  store16(v, hi);
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(hi)));
  return _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
}

// 32 inputs of a row (n of them, the rest zeros) as one 64-byte row of an A tile; LO: the lo halves of fp32
// inputs (residue) instead.
template <typename X, bool LO = false>
inline void tile_row(const X* src, int64_t n, at::BFloat16* dst) {
  if constexpr (std::is_same_v<X, float>) {
    for (int h = 0; h < 2; ++h) {
      const int64_t m = std::clamp<int64_t>(n - 16 * h, 0, 16);
      const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << m) - 1), src + 16 * h);
      store16(LO ? residue(v) : v, dst + 16 * h);
    }
  } else {
    const __mmask32 mask = n >= 32 ? ~0u : (1u << n) - 1;
    _mm512_store_si512(dst, _mm512_maskz_loadu_epi16(mask, src));
  }
}

// 16 sums of a row of y (n of them kept), times the weight rows' scales, plus their biases, rounded once to X.
template <typename X>
inline void store_row(__m512 v, int64_t n, X* dst) {
  const __mmask16 mask = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  if constexpr (std::is_same_v<X, float>) {
    _mm512_mask_storeu_ps(dst, mask, v);
  } else {
    alignas(32) at::BFloat16 row[16];
    store16(v, row);
    _mm256_mask_storeu_epi16(dst, mask, _mm256_load_si256(reinterpret_cast<const __m256i*>(row)));
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// x [M, K] as A tiles: tile t, step s, row r -> [(t * steps + s) * TILE + r * TK ...]; zeros past M and K; SPLIT
// (fp32 x): the lo halves' tiles follow, xtiles * steps * TILE on. Kept per calling thread: a fresh buffer of
// megabytes each call cost more in page faults than its copy.
template <typename X, bool SPLIT = false>
inline const at::BFloat16* x_tiles(const X* x, int64_t M, int64_t K) {
  const int64_t steps = (K + TK - 1) / TK, xtiles = (M + TR - 1) / TR, size = xtiles * steps * TILE;
  static thread_local std::vector<at::BFloat16> held;
  held.resize(std::max<size_t>(held.size(), (SPLIT ? 2 : 1) * size + TK));
  at::BFloat16* xa = aligned(held.data());
  at::parallel_for(0, xtiles * TR, TR, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t n = m < M ? std::min(TK, K - s * TK) : 0, at = (m / TR * steps + s) * TILE + m % TR * TK;
        tile_row(x + m * K + s * TK, n, xa + at);
        if constexpr (SPLIT) tile_row<X, true>(x + m * K + s * TK, n, xa + size + at);
      }
  });
  return xa;
}

// Rows [t * TR, ...) of y (xt tiles of them, those below M) at the 32 columns from n (the first `left` of them)
// from tiles<>'s sums: times the weight rows' scales (scale(j) for column j), plus their biases.
template <typename X, typename Scale>
inline void store_tiles(float (*sums)[TR][TR], int64_t t, int64_t xt, int64_t M, int64_t n, int64_t left,
                        const Scale& scale, const float* bias, X* y, int64_t N) {
  for (int64_t c = 0; c < 2; ++c) {
    const int64_t n0 = n + c * TR, kept = std::min<int64_t>(TR, left - c * TR);
    if (kept <= 0) break;
    alignas(64) float sc[TR], add[TR];
    for (int64_t j = 0; j < TR; ++j) {
      sc[j] = j < kept ? scale(n0 + j) : 0.f;
      add[j] = bias && j < kept ? bias[n0 + j] : 0.f;
    }
    const __m512 vs = _mm512_load_ps(sc), va = _mm512_load_ps(add);
    for (int64_t a = 0; a < xt; ++a)
      for (int64_t i = 0; i < TR && (t + a) * TR + i < M; ++i)
        store_row(_mm512_fmadd_ps(_mm512_load_ps(sums[2 * a + c][i]), vs, va), kept, y + ((t + a) * TR + i) * N + n0);
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The loop every matmul here shares: y [M, N] in Y = x [M, K] (X) against blocks of B weight rows (block_rows)
// split over the threads; block_tiles(n0, rows, B) gives a block's B tiles (sub-block q at q * steps * TILE, whole
// pairs of sub-blocks), scale(n) its rows' scales. SPLIT: fp32 x and weight each as bf16 hi + lo, the weight's lo
// tiles `lo` elements after its hi ones.
template <bool SPLIT = false, typename X, typename Y, typename BlockTiles, typename Scale>
inline void drive(const X* x, int64_t M, int64_t N, int64_t K, const float* bias, Y* y, const BlockTiles& block_tiles,
                  const Scale& scale, int64_t lo = 0) {
  using T = at::BFloat16;
  const int64_t steps = (K + TK - 1) / TK, xtiles = (M + TR - 1) / TR;
  const T* xa = x_tiles<X, SPLIT>(x, M, K);
  const int64_t xlo = xtiles * steps * TILE;
  const int64_t B = block_rows(N, K, at::get_num_threads());
  at::parallel_for(0, (N + B - 1) / B, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float sums[4][TR][TR];
    configure();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * B, rows = std::min(B, N - n0);
      const T* wb = block_tiles(n0, rows, B);
      for (int64_t t = 0; t < xtiles; t += 2) {
        const int64_t xt = std::min<int64_t>(2, xtiles - t);
        const T* x0 = xa + t * steps * TILE;
        for (int64_t q = 0; q * TR < rows; q += 2) {
          const T* w0 = wb + q * steps * TILE;
          const T* x1 = xt == 2 ? x0 + steps * TILE : nullptr;
          Operands o{x0, x1, w0, w0 + steps * TILE};
          if constexpr (SPLIT) o.x0l = x0 + xlo, o.x1l = x1 ? x1 + xlo : nullptr, o.w0l = o.w0 + lo, o.w1l = o.w1 + lo;
          if (xt == 2) tiles<2, SPLIT>(o, steps, sums);
          else tiles<1, SPLIT>(o, steps, sums);
          store_tiles(sums, t, xt, M, n0 + q * TR, rows - q * TR, scale, bias, y, N);
        }
      }
    }
    _tile_release();
  });
}
#endif

// y [M, N] in X = x [M, K] @ w^T (* the rows' scales) (+ bias [N] fp32), X float or BFloat16, w a widen_gemm.h
// source, the products in bf16 on the tile unit; fp32 sums, one rounding to X.
template <typename X, typename Source>
inline void gemm(const X* x, int64_t M, const Source& w, int64_t N, int64_t K, const float* bias, X* y) {
  TORCH_CHECK(available(), "amx_gemm: this CPU, build or kernel does not run the tile unit (AMX bf16)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  using T = at::BFloat16;
  const int64_t steps = (K + TK - 1) / TK;
  // Each block widened into the thread's buffer as A tiles (row r at r * TK), then each transposed by pairs.
  auto widened = [&](int64_t n0, int64_t rows, int64_t B) -> const T* {
    static thread_local std::vector<T> held;
    held.resize(B * steps * TK + TK);
    T* buf = aligned(held.data());
    if (rows < B || K % TK) std::fill(buf, buf + B * steps * TK, from_float<T>(0.f));
    for (int64_t r = 0; r < rows; ++r) w.row(n0 + r, buf + (r / TR * steps * TR + r % TR) * TK, TILE);
    for (int64_t i = 0; i < (rows + TR - 1) / TR * steps; ++i) transpose16(buf + i * TILE);
    return buf;
  };
  drive(x, M, N, K, bias, y, widened, [&](int64_t n) { return w.row_scale(n); });
#endif
}

// Panels of a bf16 weight [N, K] for gemm_packed: the B tiles gemm widens per call, made once (a dense bf16
// weight needs no widening, only this layout). Group g of 16 rows, step s -> out[(g * steps + s) * TILE ...],
// each a 16 x 32 block transposed by pairs; zeros past N (to whole pairs of groups) and K.
inline int64_t panel_size(int64_t N, int64_t K) {
  return (N + 2 * TR - 1) / (2 * TR) * 2 * TR * ((K + TK - 1) / TK) * TK;
}

inline void pack(const at::BFloat16* w, int64_t N, int64_t K, at::BFloat16* out) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const int64_t steps = (K + TK - 1) / TK, groups = panel_size(N, K) / (steps * TILE);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t s = 0; s < steps; ++s) {
        at::BFloat16* tile = out + (g * steps + s) * TILE;
        for (int64_t r = 0; r < TR; ++r) {
          const int64_t n = g * TR + r, k = s * TK;
          tile_row(w + n * K + k, n < N ? std::min(TK, K - k) : 0, tile + r * TK);
        }
        transpose16(tile);
      }
  });
#endif
}

// y [M, N] in Y = x [M, K] in X (each float or BFloat16) @ w^T (+ bias [N] fp32) over pack(w)'s panels, on
// the tile unit: the products in bf16, fp32 sums, one rounding to Y. A row's sums are the same whatever the other
// rows.
template <typename X, typename Y>
inline void gemm_packed(const X* x, int64_t M, const at::BFloat16* panels, int64_t N, int64_t K, const float* bias,
                        Y* y) {
  TORCH_CHECK(available(), "amx_gemm: this CPU, build or kernel does not run the tile unit (AMX bf16)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const int64_t steps = (K + TK - 1) / TK;
  drive(x, M, N, K, bias, y, [&](int64_t n0, int64_t, int64_t) { return panels + n0 / TR * steps * TILE; },
        [](int64_t) { return 1.f; });
#endif
}

// y [M, N] = x [M, K] @ w^T (+ bias [N] fp32), all fp32, over panels of w's bf16 hi and lo halves (pack of
// bf16(w), then of bf16(w - bf16(w)), `panel_size(N, K)` each, one after the other): every product x w as
// hi hi + lo hi + hi lo on the tile unit, each exact in fp32, the sums fp32. x and w are then carried to about 16
// of fp32's 24 bits (what torch's float32 matmul precision "high" allows: "each float32 as the sum of two
// bfloat16"), so a sum is off by about 2^-17 of sum |x w| beyond fp32's own rounding.
inline void gemm_split(const float* x, int64_t M, const at::BFloat16* panels, int64_t N, int64_t K,
                       const float* bias, float* y) {
  TORCH_CHECK(available(), "amx_gemm: this CPU, build or kernel does not run the tile unit (AMX bf16)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const int64_t steps = (K + TK - 1) / TK;
  drive<true>(x, M, N, K, bias, y, [&](int64_t n0, int64_t, int64_t) { return panels + n0 / TR * steps * TILE; },
              [](int64_t) { return 1.f; }, panel_size(N, K));
#endif
}

}  // namespace tessera_amx
