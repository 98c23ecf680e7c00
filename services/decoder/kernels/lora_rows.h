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
// dot product in a fixed order, per (row, column) one chain over the rank rows in order (bf16 over bf16 arenas on
// a CPU with avx512_bf16: its dot product, two rank rows per step, as gemv_bf16.h). So a row's result depends
// neither on the other rows nor on the thread count (the decode stack's batch invariance).
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
static_assert(BLOCK <= tessera_vec::MAX_ROWS, "a block's rows are one of tessera_vec::with_rows' counts");

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

// How a call's blocks ask for the adapter rows they read next, the execution plan's choice (lora/pool.py,
// lora_prefetch): off, the hardware prefetchers alone; burst, all of a block's Bt rows before its shrink and the
// next block's A rows before its expand; paced, the same lines a few at every step of the phase before, so that
// the requests flow beside the loads instead of queueing at once. On a Zen 4 (family 25 model 17, 2 threads, 4 and
// 64 rows on distinct adapters from memory, bench/lora_reading.py) paced ran 1.04-1.26x as fast as burst.
enum class Ahead : int64_t { off = 0, burst = 1, paced = 2 };

// An Ahead from its value in lora_cpu.PREFETCH, checked for `who`.
inline Ahead ahead_of(int64_t value, const char* who) {
  TORCH_CHECK(value >= 0 && value <= 2, who, ": prefetch is 0 (off), 1 (burst) or 2 (paced), got ", value);
  return static_cast<Ahead>(value);
}

// Lines asked for at a pace: `per` at every step of a loop, until `left` bytes are asked (none by default).
struct Pace {
  const char* p = nullptr;
  int64_t left = 0, per = 0;

  Pace() = default;
  Pace(const void* first, int64_t bytes, int64_t steps)
      : p(static_cast<const char*>(first)), left(bytes), per((bytes / 64 + steps) / std::max<int64_t>(1, steps)) {}
  void step() {
    for (int64_t i = 0; i < per && left > 0; ++i, p += 64, left -= 64) __builtin_prefetch(p, 0, 2);
  }
};

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
inline void dots(const float* const* x, const W* a, int64_t K, float* h, int64_t hs, Pace& pace) {
  __m512 acc[R][J][2];
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) acc[m][j][0] = acc[m][j][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    pace.step();
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

#ifdef __AVX512BF16__
#define TESSERA_LORA_DOT_BF16 1
// dots over bf16 x and a with the CPU's bf16 dot product (32 products per instruction, no widening; as
// gemv_bf16.h: the products are exact, the fp32 sums in another order, subnormals count as zero).
inline __m512bh load_bh(const c10::BFloat16* p, __mmask32 k) { return (__m512bh)_mm512_maskz_loadu_epi16(k, p); }
inline __mmask32 first32(int64_t n) { return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1); }

template <int R, int J>
inline void dots(const c10::BFloat16* const* x, const c10::BFloat16* a, int64_t K, float* h, int64_t hs,
                 Pace& pace) {
  __m512 acc[R][J][2];
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) acc[m][j][0] = acc[m][j][1] = _mm512_setzero_ps();
  const __mmask32 all = ~__mmask32{0};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    pace.step();
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) {
      const __m512bh a0 = load_bh(a + j * K + k, all), a1 = load_bh(a + j * K + k + 32, all);
      _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
        acc[m][j][0] = _mm512_dpbf16_ps(acc[m][j][0], load_bh(x[m] + k, all), a0);
        acc[m][j][1] = _mm512_dpbf16_ps(acc[m][j][1], load_bh(x[m] + k + 32, all), a1);
      }
    }
  }
  if (k < K) {  // the rest, as dots' over fp32: at most two steps, one into each accumulator
    const __mmask32 mask = first32(K - k);
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) {
      const __m512bh av = load_bh(a + j * K + k, mask);
      _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
        acc[m][j][0] = _mm512_dpbf16_ps(acc[m][j][0], load_bh(x[m] + k, mask), av);
    }
    k += 32;
  }
  if (k < K) {
    const __mmask32 mask = first32(K - k);
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j) {
      const __m512bh av = load_bh(a + j * K + k, mask);
      _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
        acc[m][j][1] = _mm512_dpbf16_ps(acc[m][j][1], load_bh(x[m] + k, mask), av);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int j = 0; j < J; ++j)
      h[m * hs + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][j][0], acc[m][j][1]));
}

// columns over bf16 rows of Bt with the bf16 dot product, for h already rounded to bf16 (its values exact):
// hp[m * pr + p] holds row m's h[2p] (low half) and h[2p + 1] (high; 0 past r), pr = (r + 1) / 2. Rows 2p and
// 2p + 1 of Bt are interleaved per column, so each instruction adds both rank rows' products to 16 columns; the
// lanes come out in the unpack's order and are put back in column order at the end. Each column's sum takes the
// same steps whatever R and C are. d[m * 32 C + i] for the 32 C columns from n (the last 32 masked by `last`).
template <int R, int C>
inline void columns(const uint32_t* hp, int64_t r, const c10::BFloat16* bt, int64_t N, int64_t n, __mmask32 last,
                    float* d, Pace& pace) {
  const int64_t pr = (r + 1) / 2;
  __m512 acc[R][C][2];
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[m][c][0] = acc[m][c][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pr; ++p) {
    pace.step();
    __m512i lo[C], hi[C];
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) {
      const __mmask32 k = c == C - 1 ? last : ~__mmask32{0};
      const __m512i b0 = _mm512_maskz_loadu_epi16(k, bt + 2 * p * N + n + 32 * c);
      const __m512i b1 = 2 * p + 1 < r ? _mm512_maskz_loadu_epi16(k, bt + (2 * p + 1) * N + n + 32 * c)
                                       : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(b0, b1);
      hi[c] = _mm512_unpackhi_epi16(b0, b1);
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m) {
      const __m512bh hv = (__m512bh)_mm512_set1_epi32(static_cast<int>(hp[m * pr + p]));
      _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) {
        acc[m][c][0] = _mm512_dpbf16_ps(acc[m][c][0], hv, (__m512bh)lo[c]);
        acc[m][c][1] = _mm512_dpbf16_ps(acc[m][c][1], hv, (__m512bh)hi[c]);
      }
    }
  }
  // Lane 4 l + i of lo is column 8 l + i of the 32, of hi column 8 l + 4 + i (the unpacks work per 128 bits).
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) {
      float* out = d + m * 32 * C + 32 * c;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(acc[m][c][0], first16, acc[m][c][1]));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(acc[m][c][0], second16, acc[m][c][1]));
    }
}

// h (rounded to bf16) as columns' pairs: hp [R * (r + 1) / 2].
inline void pair_up(const float* h, int R, int64_t r, uint32_t* hp) {
  const int64_t pr = (r + 1) / 2;
  auto bits = [](float v) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    return b >> 16;
  };
  for (int m = 0; m < R; ++m)
    for (int64_t p = 0; p < pr; ++p)
      hp[m * pr + p] = bits(h[m * r + 2 * p]) | (2 * p + 1 < r ? bits(h[m * r + 2 * p + 1]) << 16 : 0u);
}
#endif

// d[m * 16 C + i] = sum_j h[m * r + j] * bt[j * N + n + i] for the C vectors of columns from n (the last one
// masked by `last`), one FMA chain per column over j in order.
template <int R, int C, typename W>
inline void columns(const float* h, int64_t r, const W* bt, int64_t N, int64_t n, __mmask16 last, float* d,
                    Pace& pace) {
  __m512 acc[R][C];
  _Pragma("GCC unroll 16") for (int m = 0; m < R; ++m)
    _Pragma("GCC unroll 16") for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < r; ++j) {
    pace.step();
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

// Reading rows of a new adapter, the hardware prefetcher starts each stream cold, so a block asks for its rows
// (Ahead). Asked in a burst, they saved 10% of the time for 64 rows on 64 adapters out of cache (Zen 4, one
// thread); on an Intel Xeon (family 6 model 167, 2 threads) fp32 rows took 12-17% longer (the core waits while a
// block's requests queue) and bf16 rows 10-17% less.
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(p) + i, 0, 2);
}

// y[i] = y[i] + delta[i] over w columns, rounded as the torch path stores them (ROUND: the delta and the sum).
template <bool ROUND, typename Y>
inline void finish(Y* y, const float* d, int64_t w) {
#pragma omp simd
  for (int64_t i = 0; i < w; ++i) put(y, i, rnd<ROUND>(widen(y[i]) + rnd<ROUND>(d[i])));
}

// One block of R rows on one adapter: x[m] rows (fp32, or bf16 for the dot product), y[m] their outputs; h [R r],
// d [R * 128] and hp [R (r + 1) / 2] scratch; next, next_bytes: the next block's A rows (null: none). Paced, the
// shrink's steps ask for this block's Bt rows and the expand's for `next`; in bursts, `next` is asked for after the
// shrink (and the Bt rows by rows(), before it).
template <int R, bool ROUND, typename XR, typename W, typename Y>
void block(const XR* const* x, Y* const* y, const W* a, const W* bt, int64_t K, int64_t N, int64_t r, float* h,
           float* d, uint32_t* hp, Ahead ahead, const W* next, int64_t next_bytes) {
  const bool paced = ahead == Ahead::paced;
  Pace shrink, expand;  // what the shrink's and the expand's steps ask for, where paced
#ifdef __AVX512F__
  constexpr int J = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // rank rows per pass over x: 8 to 16 accumulators
  constexpr int64_t STEP = std::is_same_v<XR, c10::BFloat16> ? 64 : 32;  // dots' inputs per step
  if (paced) shrink = Pace(bt, r * N * static_cast<int64_t>(sizeof(W)), (r / J + r % J) * (K / STEP));
  int64_t j = 0;
  for (; j + J <= r; j += J) dots<R, J>(x, a + j * K, K, h + j, r, shrink);
  for (; j < r; ++j) dots<R, 1>(x, a + j * K, K, h + j, r, shrink);  // the same sums as in the J-row pass
#else
  if (paced) shrink = Pace(bt, r * N * static_cast<int64_t>(sizeof(W)), R * r);
  for (int m = 0; m < R; ++m)
    for (int64_t j = 0; j < r; ++j) {
      shrink.step();
      h[m * r + j] = dot(x[m], a + j * K, K);
    }
#endif
  if constexpr (ROUND)
    for (int64_t i = 0; i < R * r; ++i) h[i] = tessera_glue::to_bf16(h[i]);
  if (next && ahead == Ahead::burst) prefetch(next, next_bytes);
#ifdef TESSERA_LORA_DOT_BF16
  if constexpr (ROUND && std::is_same_v<W, c10::BFloat16>) {
    constexpr int C = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // 32 columns per step: 4 to 16 accumulators
    if (next && paced) expand = Pace(next, next_bytes, (N / (32 * C) + (N % (32 * C) + 31) / 32) * ((r + 1) / 2));
    pair_up(h, R, r, hp);
    int64_t n = 0;
    for (; n + 32 * C <= N; n += 32 * C) {
      columns<R, C>(hp, r, bt, N, n, ~__mmask32{0}, d, expand);
      for (int m = 0; m < R; ++m) finish<ROUND>(y[m] + n, d + m * 32 * C, 32 * C);
    }
    for (; n < N; n += 32) {
      columns<R, 1>(hp, r, bt, N, n, first32(N - n), d, expand);
      for (int m = 0; m < R; ++m) finish<ROUND>(y[m] + n, d + m * 32, std::min<int64_t>(32, N - n));
    }
    return;
  }
#endif
#ifdef __AVX512F__
  constexpr int C = R <= 2 ? 8 : R <= 4 ? 4 : 2;  // column vectors per pass over Bt: 8 to 16 accumulators
  if (next && paced) expand = Pace(next, next_bytes, (N / (16 * C) + (N % (16 * C) + 15) / 16) * r);
  int64_t n = 0;
  for (; n + 16 * C <= N; n += 16 * C) {
    columns<R, C>(h, r, bt, N, n, ALL, d, expand);
    for (int m = 0; m < R; ++m) finish<ROUND>(y[m] + n, d + m * 16 * C, 16 * C);
  }
  for (; n < N; n += 16) {
    columns<R, 1>(h, r, bt, N, n, first(N - n), d, expand);
    for (int m = 0; m < R; ++m) finish<ROUND>(y[m] + n, d + m * 16, std::min<int64_t>(16, N - n));
  }
#else
  if (next && paced) expand = Pace(next, next_bytes, R * ((N + 127) / 128));
  for (int m = 0; m < R; ++m)
    for (int64_t n = 0; n < N; n += 128) {
      expand.step();
      const int64_t w = std::min<int64_t>(128, N - n);
      axpys(h + m * r, r, bt, N, n, w, d);
      finish<ROUND>(y[m] + n, d, w);
    }
#endif
}


// A task's least work, in arena weights read (and multiplied by a block's rows): below twice it a call runs on one
// thread. Which of the two wins depends on the CPU and the dtype (a split adds the threads' wake-up, a lone thread
// streams the rows at one core's bandwidth), so the execution plan times both at load (lora_cpu.py GRAINS).
constexpr int64_t COARSE = 1 << 16, FINE = 1 << 14;

// One projection's corrections: y[m, :N] += (x[m, :K] @ A[o:o+r]^T) @ Bt[o:o+r] for every row m < M with
// r = ranks[m] > 0, o = offsets[m]; x rows ldx apart, y rows ldy apart; A [P, K], Bt [P, N] contiguous.
template <typename X, typename W, typename Y>
struct Job {
  const X* x;
  int64_t ldx;
  Y* y;
  int64_t ldy;
  const W* A;
  const W* Bt;
  int64_t K, N;
  const int32_t* offsets;
  const int32_t* ranks;
  int64_t M;
};

// Every job's corrections, their blocks in one parallel region (the targets of one projection share it, so a
// few rows on several targets still fill the threads). Sums in fp32; ROUND (bf16): h, the delta and the sum each
// rounded to bf16 as torch stores them. Y may be fp32 holding bf16 values (the decode stack's buffers). The jobs'
// outputs must not overlap. grain: COARSE or FINE (or any positive count of weights); ahead: how blocks ask for
// the rows they read next.
template <bool ROUND, typename X, typename W, typename Y>
void rows(const Job<X, W, Y>* jobs, int count, int64_t grain, Ahead ahead) {
  struct Task {
    Block block;
    int job;
  };
  std::vector<Task> tasks;
  int64_t work = 0, widest = 0;
  for (int j = 0; j < count; ++j) {
    const Job<X, W, Y>& J = jobs[j];
    for (const Block& b : make_blocks(J.offsets, J.ranks, J.M)) {
      tasks.push_back(Task{b, j});
      work += b.rank * (J.K + J.N) * (1 + b.count / 4);  // reads, and the rows' FMAs
    }
    widest = std::max(widest, J.K);
  }
  if (tasks.empty()) return;
  // x as it is (fp32; or bf16 over bf16 arenas where the CPU has the bf16 dot product), else widened per block.
#ifdef TESSERA_LORA_DOT_BF16
  constexpr bool RAW = std::is_same_v<X, float> || (std::is_same_v<X, c10::BFloat16> && std::is_same_v<W, X>);
#else
  constexpr bool RAW = std::is_same_v<X, float>;
#endif
  using XR = std::conditional_t<RAW, X, float>;
  const int64_t nb = static_cast<int64_t>(tasks.size());
  const int64_t per_task = work < 2 * grain ? nb : std::max<int64_t>(1, nb * grain / work);
  at::parallel_for(0, nb, per_task, [&](int64_t b0, int64_t b1) {
    int64_t most = 0;
    for (int64_t i = b0; i < b1; ++i) most = std::max(most, tasks[i].block.rank);
    std::vector<float> h(BLOCK * most), d(BLOCK * 128), wide(RAW ? 0 : BLOCK * widest);
    std::vector<uint32_t> hp(BLOCK * (most + 1) / 2);
    for (int64_t i = b0; i < b1; ++i) {
      const Block& b = tasks[i].block;
      const Job<X, W, Y>& J = jobs[tasks[i].job];
      const int64_t K = J.K, N = J.N;
      const XR* xs[BLOCK];
      Y* ys[BLOCK];
      for (int64_t m = 0; m < b.count; ++m) {
        const X* xr = J.x + b.rows[m] * J.ldx;
        if constexpr (RAW) {
          xs[m] = xr;
        } else {
          float* w = wide.data() + m * K;
#pragma omp simd
          for (int64_t k = 0; k < K; ++k) w[k] = widen(xr[k]);
          xs[m] = w;
        }
        ys[m] = J.y + b.rows[m] * J.ldy;
      }
      if (ahead == Ahead::burst) prefetch(J.Bt + b.offset * N, b.rank * N * sizeof(W));
      const W* a = J.A + b.offset * K;
      const W* bt = J.Bt + b.offset * N;
      const W* next = nullptr;
      int64_t next_bytes = 0;
      if (ahead != Ahead::off && i + 1 < b1) {
        const Job<X, W, Y>& NJ = jobs[tasks[i + 1].job];
        next = NJ.A + tasks[i + 1].block.offset * NJ.K;
        next_bytes = tasks[i + 1].block.rank * NJ.K * sizeof(W);
      }
      tessera_vec::with_rows(b.count, "lora rows", [&](auto R) {
        block<R.value, ROUND>(xs, ys, a, bt, K, N, b.rank, h.data(), d.data(), hp.data(), ahead, next, next_bytes);
      });
    }
  });
}

}  // namespace tessera_lora
