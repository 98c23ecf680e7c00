// Multi-LoRA over the rows of a step on CPU, each row its own adapter: the loops, shared by lora_cpu.cpp (the
// operator; its launcher, semantics and torch reference are in lora_cpu.py) and decode_stack_cpu.cpp.
//
// Row m adds (x[m] @ A[o:o+r]^T) @ Bt[o:o+r] for (o, r) = (offsets[m], ranks[m]), where A [P, K] and Bt [P, N]
// are an "arena" holding the rank rows of many adapters at any offsets, ranks mixed, no padding. The cost is
// reading those rows (r (K + N) weights against 2 r (K + N) flops per row), so the loops stream: the rows with
// one (o, r), consecutive or not, are cut into blocks of up to BLOCK rows that share one read of A and Bt
// (SGMV; a lone row is BGMV), and the blocks run on the threads.
//
// Each row's sums are the same whatever block it lands in and whichever thread runs it: per (row, rank row) one
// dot product in a fixed order, per (row, column) one FMA chain over the rank rows in order. So a row's result
// depends neither on the other rows nor on the thread count (the decode stack's batch invariance).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "glue.h"

#include <algorithm>
#include <cstdint>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace tessera_lora {

using tessera_glue::put;
using tessera_glue::rnd;
using tessera_vec::widen;

constexpr int BLOCK = 8;  // rows sharing one read of their adapter's rows: their accumulators fill the registers

// Up to BLOCK rows with one (offset, rank).
struct Block {
  int64_t rows[BLOCK];
  int64_t count, offset, rank;
};

// The blocks of M rows: rows with equal (offset, rank) gathered (a stable sort, so the blocks are the same on
// every call with these spans) and cut into BLOCK rows; rank-0 rows get none.
inline std::vector<Block> make_blocks(const int32_t* offsets, const int32_t* ranks, int64_t M) {
  std::vector<int64_t> order;
  for (int64_t m = 0; m < M; ++m)
    if (ranks[m] > 0) order.push_back(m);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return offsets[a] != offsets[b] ? offsets[a] < offsets[b] : ranks[a] < ranks[b];
  });
  std::vector<Block> blocks;
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t m = order[i];
    if (blocks.empty() || blocks.back().count == BLOCK || blocks.back().offset != offsets[m] ||
        blocks.back().rank != ranks[m])
      blocks.push_back(Block{{}, 0, offsets[m], ranks[m]});
    Block& b = blocks.back();
    b.rows[b.count++] = m;
  }
  return blocks;
}

// Every row's span [o, o + r) lies in an arena of P rows (rank 0: anything goes, nothing is read).
inline void check_spans(const int32_t* offsets, const int32_t* ranks, int64_t M, int64_t P, const char* what) {
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(ranks[m] >= 0, what, ": row ", m, " has rank ", ranks[m]);
    TORCH_CHECK(ranks[m] == 0 || (offsets[m] >= 0 && offsets[m] + static_cast<int64_t>(ranks[m]) <= P), what,
                ": row ", m, " reads arena rows [", offsets[m], ", ", offsets[m] + static_cast<int64_t>(ranks[m]),
                ") of ", P);
  }
}

#ifdef __AVX512F__
inline __m512 load(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load(const c10::BFloat16* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
constexpr __mmask16 ALL = 0xFFFF;
// The loops over a block's rows, rank rows and column vectors below are unrolled by pragma: left to GCC 12's
// later unrolling, the accumulator arrays stayed in memory, stored on every step (twice the time).
inline __mmask16 first(int64_t n) { return n >= 16 ? ALL : static_cast<__mmask16>((1u << n) - 1); }

// h[m * hs + j] = x[m] . a[j] over K for R rows of x and J rows of a: two accumulators per pair, so a lone row
// (J = 4) still has eight chains in flight. Every pair's sum takes the same steps whatever R and J are.
template <int R, int J, typename W>
inline void dots(const float* const* x, const W* a, int64_t K, float* h, int64_t hs) {
  __m512 acc[R][J][2];
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) acc[m][j][0] = acc[m][j][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) {
      const __m512 a0 = load(a + j * K + k, ALL), a1 = load(a + j * K + k + 16, ALL);
      _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
        acc[m][j][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x[m] + k), a0, acc[m][j][0]);
        acc[m][j][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x[m] + k + 16), a1, acc[m][j][1]);
      }
    }
  }
  // The rest: at most two vectors, the last maybe partial, one into each accumulator (written out: a lambda
  // over acc kept it in memory).
  if (k < K) {
    const __mmask16 mask = first(K - k);
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) {
      const __m512 av = load(a + j * K + k, mask);
      _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) acc[m][j][0] = _mm512_fmadd_ps(load(x[m] + k, mask), av, acc[m][j][0]);
    }
    k += 16;
  }
  if (k < K) {
    const __mmask16 mask = first(K - k);
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) {
      const __m512 av = load(a + j * K + k, mask);
      _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) acc[m][j][1] = _mm512_fmadd_ps(load(x[m] + k, mask), av, acc[m][j][1]);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) h[m * hs + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][j][0], acc[m][j][1]));
}

// d[m * 16 C + i] = sum_j h[m * r + j] * bt[j * N + n + i] for the C vectors of columns from n (the last one
// masked by `last`), one FMA chain per column over j in order.
template <int R, int C, typename W>
inline void columns(const float* h, int64_t r, const W* bt, int64_t N, int64_t n, __mmask16 last, float* d) {
  __m512 acc[R][C];
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < r; ++j) {
    __m512 b[C];
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) b[c] = load(bt + j * N + n + 16 * c, c == C - 1 ? last : ALL);
    _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
      const __m512 hv = _mm512_set1_ps(h[m * r + j]);
      _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[m][c] = _mm512_fmadd_ps(hv, b[c], acc[m][c]);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) _mm512_storeu_ps(d + m * 16 * C + 16 * c, acc[m][c]);
}
#else
// The portable loops (no AVX-512): one function per dot product and per row's columns, so that every row's
// sums are compiled once and do not depend on the block they are in.
template <typename W>
__attribute__((noinline)) float dot(const float* x, const W* a, int64_t K) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < K; ++k) s += x[k] * widen(a[k]);
  return s;
}

template <typename W>
__attribute__((noinline)) void axpys(const float* h, int64_t r, const W* bt, int64_t N, int64_t n, int64_t w,
                                     float* d) {
  for (int64_t i = 0; i < w; ++i) d[i] = 0.f;
  for (int64_t j = 0; j < r; ++j) {
    const float hj = h[j];
    const W* b = bt + j * N + n;
#pragma omp simd
    for (int64_t i = 0; i < w; ++i) d[i] += hj * widen(b[i]);
  }
}
#endif

// y[i] = y[i] + delta[i] over w columns, rounded as the torch path stores them (ROUND: the delta and the sum).
template <bool ROUND, typename Y>
inline void finish(Y* y, const float* d, int64_t w) {
#pragma omp simd
  for (int64_t i = 0; i < w; ++i) put(y, i, rnd<ROUND>(widen(y[i]) + rnd<ROUND>(d[i])));
}

// One block of R rows on one adapter: x[m] fp32 rows, y[m] their outputs; h [R * r] and d [R * 128] scratch.
template <int R, bool ROUND, typename W, typename Y>
void block(const float* const* x, Y* const* y, const W* a, const W* bt, int64_t K, int64_t N, int64_t r, float* h,
           float* d) {
#ifdef __AVX512F__
  constexpr int J = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // rank rows per pass over x: 8 to 16 accumulators
  int64_t j = 0;
  for (; j + J <= r; j += J) dots<R, J>(x, a + j * K, K, h + j, r);
  for (; j < r; ++j) dots<R, 1>(x, a + j * K, K, h + j, r);
#else
  for (int m = 0; m < R; ++m)
    for (int64_t j = 0; j < r; ++j) h[m * r + j] = dot(x[m], a + j * K, K);
#endif
  if constexpr (ROUND)
    for (int64_t i = 0; i < R * r; ++i) h[i] = tessera_glue::to_bf16(h[i]);
#ifdef __AVX512F__
  constexpr int C = R <= 2 ? 8 : R <= 4 ? 4 : 2;  // column vectors per pass over Bt: 8 to 16 accumulators
  int64_t n = 0;
  for (; n + 16 * C <= N; n += 16 * C) {
    columns<R, C>(h, r, bt, N, n, ALL, d);
    for (int m = 0; m < R; ++m) finish<ROUND>(y[m] + n, d + m * 16 * C, 16 * C);
  }
  for (; n < N; n += 16) {
    columns<R, 1>(h, r, bt, N, n, first(N - n), d);
    for (int m = 0; m < R; ++m) finish<ROUND>(y[m] + n, d + m * 16, std::min<int64_t>(16, N - n));
  }
#else
  for (int m = 0; m < R; ++m)
    for (int64_t n = 0; n < N; n += 128) {
      const int64_t w = std::min<int64_t>(128, N - n);
      axpys(h + m * r, r, bt, N, n, w, d);
      finish<ROUND>(y[m] + n, d, w);
    }
#endif
}

// f(std::integral_constant<int, R>) for R = count in [1, BLOCK].
template <typename F>
inline void with_count(int64_t count, F&& f) {
  switch (count) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

constexpr int64_t GRAIN = 1 << 16;  // arena weights (read, and multiplied by a block's rows) per task at least

// y[m, :N] += (x[m, :K] @ A[o:o+r]^T) @ Bt[o:o+r] for every row m with r = ranks[m] > 0, o = offsets[m]; x rows
// ldx apart, y rows ldy apart; A [P, K], Bt [P, N] contiguous. Sums in fp32; ROUND (bf16): h, the delta and the
// sum each rounded to bf16 as torch stores them. Y may be fp32 holding bf16 values (the decode stack's buffers).
template <bool ROUND, typename X, typename W, typename Y>
void rows(const X* x, int64_t ldx, Y* y, int64_t ldy, const W* A, const W* Bt, int64_t K, int64_t N,
          const int32_t* offsets, const int32_t* ranks, int64_t M) {
  const std::vector<Block> blocks = make_blocks(offsets, ranks, M);
  if (blocks.empty()) return;
  int64_t work = 0;
  for (const Block& b : blocks) work += b.rank * (K + N) * (1 + b.count / 4);  // reads, and the rows' FMAs
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const int64_t grain = work < 2 * GRAIN ? nb : std::max<int64_t>(1, nb * GRAIN / work);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    int64_t most = 0;
    for (int64_t i = b0; i < b1; ++i) most = std::max(most, blocks[i].rank);
    std::vector<float> h(BLOCK * most), d(BLOCK * 128), wide(std::is_same_v<X, float> ? 0 : BLOCK * K);
    for (int64_t i = b0; i < b1; ++i) {
      const Block& b = blocks[i];
      const float* xs[BLOCK];
      Y* ys[BLOCK];
      for (int64_t m = 0; m < b.count; ++m) {
        const X* xr = x + b.rows[m] * ldx;
        if constexpr (std::is_same_v<X, float>) {
          xs[m] = xr;
        } else {
          float* w = wide.data() + m * K;
#pragma omp simd
          for (int64_t k = 0; k < K; ++k) w[k] = widen(xr[k]);
          xs[m] = w;
        }
        ys[m] = y + b.rows[m] * ldy;
      }
      const W* a = A + b.offset * K;
      const W* bt = Bt + b.offset * N;
      with_count(b.count, [&](auto R) {
        block<R.value, ROUND>(xs, ys, a, bt, K, N, b.rank, h.data(), d.data());
      });
    }
  });
}

// For the decode stack: a layer's arenas per target, and one step's spans.
constexpr int TARGETS = 7;  // lora.weights.TARGETS: q, k, v, o, gate, up, down

struct Arenas {
  at::Tensor a[TARGETS], bt[TARGETS];  // undefined where the layer has none
};

// One step's rows: offsets/ranks [TARGETS, M] int32 (row t: target t); active[t]: some row has rank > 0.
struct Step {
  const int32_t* offsets = nullptr;
  const int32_t* ranks = nullptr;
  int64_t M = 0;
  bool active[TARGETS] = {};

  Step() = default;
  Step(const int32_t* o, const int32_t* r, int64_t m) : offsets(o), ranks(r), M(m) {
    for (int t = 0; t < TARGETS; ++t)
      for (int64_t i = 0; i < M && !active[t]; ++i) active[t] = r[t * M + i] > 0;
  }
  bool any(int t0, int t1) const {
    for (int t = t0; t < t1; ++t)
      if (active[t]) return true;
    return false;
  }
};

// Target t's place in a decoder layer: its projection's output columns [col, col + n) (q, k, v in the fused qkv
// output, gate and up in gate_up's) and its input width k.
struct Columns {
  int64_t col, n, k;
};
inline Columns columns(int t, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t inter) {
  const int64_t q = heads * head_dim, kv = kv_heads * head_dim;
  switch (t) {
    case 0: return {0, q, hidden};              // q_proj
    case 1: return {q, kv, hidden};             // k_proj
    case 2: return {q + kv, kv, hidden};        // v_proj
    case 3: return {0, hidden, q};              // o_proj
    case 4: return {0, inter, hidden};          // gate_proj
    case 5: return {inter, inter, hidden};      // up_proj
    default: return {0, hidden, inter};         // down_proj
  }
}

// The step of lora_offsets/lora_ranks (both or neither: none), checked against every layer's arenas
// (arenas(l) for l < layers): a target with rows on adapters needs an arena in each layer holding their spans.
template <typename F>
Step make_step(const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& ranks, int64_t M,
               int64_t layers, F&& arenas) {
  TORCH_CHECK(offsets.has_value() == ranks.has_value(), "decode_stack: lora_offsets and lora_ranks come together");
  if (!offsets.has_value()) return {};
  for (const at::Tensor* t : {&*offsets, &*ranks})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->dim() == 2 && t->size(0) == TARGETS &&
                    t->size(1) == M && t->device().is_cpu(),
                "decode_stack: lora_offsets and lora_ranks must be contiguous int32 [", TARGETS, ", ", M, "]");
  const Step step(offsets->data_ptr<int32_t>(), ranks->data_ptr<int32_t>(), M);
  for (int t = 0; t < TARGETS; ++t) {
    if (!step.active[t]) continue;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor& a = arenas(l).a[t];
      TORCH_CHECK(a.defined(), "decode_stack: rows of target ", t, " have adapters but layer ", l, " has no arena");
      check_spans(step.offsets + t * M, step.ranks + t * M, M, a.size(0), "decode_stack lora");
    }
  }
  return step;
}

}  // namespace tessera_lora
