// Decode attention over the paged KV cache, read in place (no gather): the CPU kernel.
// The launcher, its semantics and the torch reference are in paged_attention_cpu.py.
//
// A task is one row's stretch of consecutive blocks (up to SPAN tokens, see plan_tasks), for all
// heads. Per block and KV head, its G = H / KVH query heads go together (up to GC_MAX at a time):
// each K and V row is loaded once for all of them, and their independent dependency chains keep
// the FMA pipes busy. Per block and query head: n scores, one online-softmax update (running max
// m and sum l, the accumulator rescaled only when m grows), then acc += p * V. A row cut into
// several stretches is merged at the end by their (m, l). Everything accumulates in fp32; bf16
// rows are widened as they are loaded. A row may start at a first key (a sliding window: earlier
// blocks are not read, earlier keys of its block score -inf) and soft-cap its scores (cap * tanh(s /
// cap)). Threads take tasks from a shared counter, so ragged rows balance, and the next block is
// prefetched a few lines per token while this one is computed.
// Loops and GCC/Clang vector extensions compiled for the build machine (-march=native), so the
// source builds on any x86 or ARM CPU; intrinsics only where the CPU has them: AVX-512 widens bf16
// rows, avx512_bf16 takes bf16 scores by its dot product.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../common/kernels/vec.h"

namespace tessera_paged {

using tessera_vec::exp_nonpositive;
using tessera_vec::exp_sum;
using tessera_vec::hsum;
using tessera_vec::LANES;
using tessera_vec::load16;
using tessera_vec::max_of;
using tessera_vec::v16;
using tessera_vec::v4;
using tessera_vec::v8;
using tessera_vec::widen;

// Folding the 16 partial sums of 16 dot products into one vector of their 16 totals, two
// vectors at a time: fold8(a, b) = [a's 8 pair sums | b's 8], fold4 of two of those = 4 lanes per
// token for 4 tokens, and so on. 15 two-source shuffle+add steps for 16 tokens, against 4 per
// token for hsum.
#define TS_SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
inline v16 fold8(v16 a, v16 b) {
  return TS_SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         TS_SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline v16 fold4(v16 x, v16 y) {
  return TS_SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         TS_SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline v16 fold2(v16 x, v16 y) {
  return TS_SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         TS_SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline v16 fold1(v16 x, v16 y) {
  return TS_SHUFFLE(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         TS_SHUFFLE(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef TS_SHUFFLE

// Query heads handled together (GC of one KV group): each K/V row is loaded once for all of
// them, and their independent dependency chains keep the FMA pipes busy. GC * D / LANES
// accumulators must fit the 32 vector registers next to the V row.
constexpr int GC_MAX = 4;
inline int heads_together(int64_t head_dim) { return head_dim <= 64 ? 4 : head_dim <= 128 ? 2 : 1; }

// The next block of the stretch, requested a few cache lines per token step while this one is
// computed. A row's blocks lie anywhere in the cache, so the hardware prefetcher cannot see the
// next one coming; one burst of prefetches at the block start only stalls on the full miss
// queue (measured: no gain), while spreading them over the block's work overlaps the two.
// Into L2 (locality 1): prefetching 24 KB into L1 would evict the block being computed.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0, off = 0, per_step = 0;
  inline void step() {
    for (int64_t i = 0; i < per_step && off < bytes; ++i, off += 64) {
      __builtin_prefetch(k + off, 0, 1);
      __builtin_prefetch(v + off, 0, 1);
    }
  }
};

// The 16 tokens of a block folded from their partial-sum vectors into one vector of 16 scores,
// 4 tokens at a time; partials(kt, p) fills p[g] with 16 partial sums of head g's score for token kt.
// s[g * bsp + t] = post * the score, for g < GC, t < n.
template <typename T, int GC, typename Partials>
inline void fold_scores(Partials&& partials, const T* __restrict__ K, int64_t rs, int64_t n, float* __restrict__ s,
                        int64_t bsp, float post, Ahead& ahead) {
  int64_t t = 0;
  for (; t + LANES <= n; t += LANES) {
    v16 x4[GC][4];
    for (int i = 0; i < 4; ++i) {
      v16 p0[GC], p1[GC], p2[GC], p3[GC];
      const T* kt = K + (t + 4 * i) * rs;
      ahead.step();
      ahead.step();
      ahead.step();
      ahead.step();
      partials(kt, p0);
      partials(kt + rs, p1);
      partials(kt + 2 * rs, p2);
      partials(kt + 3 * rs, p3);
      for (int g = 0; g < GC; ++g) x4[g][i] = fold4(fold8(p0[g], p1[g]), fold8(p2[g], p3[g]));
    }
    for (int g = 0; g < GC; ++g) {
      const v16 total = fold1(fold2(x4[g][0], x4[g][1]), fold2(x4[g][2], x4[g][3])) * post;
      std::memcpy(s + g * bsp + t, &total, sizeof total);
    }
  }
  for (; t < n; ++t) {
    ahead.step();
    v16 p[GC];
    partials(K + t * rs, p);
    for (int g = 0; g < GC; ++g) s[g * bsp + t] = hsum(p[g]) * post;
  }
}

// s[g * bsp + t] = q[g] . K[t] for g < GC, t < n; q [GC, D] contiguous (fp32, scaled), K rows `rs`
// floats apart. DC % LANES == 0: vectors, 16 tokens folded at a time; else plain loops over runtime D.
// qb/scale: on CPUs with the bf16 dot product (avx512_bf16), bf16 rows with DC % 32 == 0 take it over
// qb, q's own unscaled bf16 values [GC, D], and the scale is applied to the folded scores: products of
// two bf16 are exact in fp32 either way, only the order of the fp32 sums differs (and, as the
// instruction does, subnormal inputs and sums count as zero). About a third of the instructions a
// token of widening K and 4 FMAs a head.
template <typename T, int DC, int GC>
inline void group_scores(const float* __restrict__ q, const c10::BFloat16* __restrict__ qb, float scale,
                         const T* __restrict__ K, int64_t rs, int64_t n, float* __restrict__ s, int64_t bsp,
                         int d_runtime, Ahead& ahead) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16> && DC > 0 && DC % 32 == 0) {
    constexpr int NV = DC / 32;
    __m512bh qv[GC][NV];
    for (int g = 0; g < GC; ++g)
      for (int i = 0; i < NV; ++i) qv[g][i] = (__m512bh)_mm512_loadu_si512(qb + g * DC + i * 32);
    auto partials = [&](const T* kt, v16* p) {
      __m512bh kv[NV];
      for (int i = 0; i < NV; ++i) kv[i] = (__m512bh)_mm512_loadu_si512(kt + i * 32);
      for (int g = 0; g < GC; ++g) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
        for (int i = 1; i < NV; ++i) acc = _mm512_dpbf16_ps(acc, qv[g][i], kv[i]);
        p[g] = (v16)acc;
      }
    };
    fold_scores<T, GC>(partials, K, rs, n, s, bsp, scale, ahead);
    return;
  }
#endif
  if constexpr (DC > 0 && DC % LANES == 0) {
    constexpr int NV = DC / LANES;
    v16 qv[GC][NV];
    for (int g = 0; g < GC; ++g)
      for (int i = 0; i < NV; ++i) qv[g][i] = load16(q + g * DC + i * LANES);
    auto partials = [&](const T* kt, v16* p) {  // p[g]: 16 partial sums of q[g] . kt
      v16 kv[NV];
      for (int i = 0; i < NV; ++i) kv[i] = load16(kt + i * LANES);
      for (int g = 0; g < GC; ++g) {
        p[g] = qv[g][0] * kv[0];
        for (int i = 1; i < NV; ++i) p[g] += qv[g][i] * kv[i];
      }
    };
    fold_scores<T, GC>(partials, K, rs, n, s, bsp, 1.0f, ahead);
  } else {
    const int D = DC ? DC : d_runtime;
    for (int g = 0; g < GC; ++g)
      for (int64_t t = 0; t < n; ++t) {
        const T* kt = K + t * rs;
        const float* qg = q + g * D;
        float part[LANES] = {};
        int d0 = 0;
        for (; d0 + LANES <= D; d0 += LANES)
          for (int j = 0; j < LANES; ++j) part[j] += qg[d0 + j] * widen(kt[d0 + j]);
        for (int j = 0; d0 + j < D; ++j) part[j] += qg[d0 + j] * widen(kt[d0 + j]);
        float sum = 0.0f;
        for (int j = 0; j < LANES; ++j) sum += part[j];
        s[g * bsp + t] = sum;
      }
  }
}

// acc[g] += sum_t s[g * bsp + t] * V[t] for g < GC, t < n; acc [GC, D], V rows `rs` floats apart.
// The vector path keeps acc in registers over the block (through memory, each token's update
// would wait on the previous store).
template <typename T, int DC, int GC>
inline void group_accumulate(float* __restrict__ acc, const T* __restrict__ V, int64_t rs, int64_t n,
                             const float* __restrict__ s, int64_t bsp, int d_runtime, Ahead& ahead) {
  if constexpr (DC > 0 && DC % LANES == 0) {
    constexpr int NV = DC / LANES;
    v16 a[GC][NV];
    for (int g = 0; g < GC; ++g)
      for (int i = 0; i < NV; ++i) a[g][i] = load16(acc + g * DC + i * LANES);
    for (int64_t t = 0; t < n; ++t) {
      ahead.step();
      v16 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16(V + t * rs + i * LANES);
      for (int g = 0; g < GC; ++g) {
        const v16 pt = v16{} + s[g * bsp + t];
        for (int i = 0; i < NV; ++i) a[g][i] += pt * vv[i];
      }
    }
    std::memcpy(acc, a, sizeof a);
  } else {
    const int D = DC ? DC : d_runtime;
    for (int g = 0; g < GC; ++g)
      for (int64_t t = 0; t < n; ++t)
        for (int d = 0; d < D; ++d) acc[g * D + d] += s[g * bsp + t] * widen(V[t * rs + d]);
  }
}

// f(std::integral_constant<int, gc>) for a runtime gc in [1, GC_MAX].
template <typename F>
inline void with_heads(int gc, F&& f) {
  switch (gc) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

struct Problem {
  int64_t rows, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks;
  int64_t q_row_stride, q_head_stride, out_row_stride, out_head_stride;
  float scale, softcap;  // softcap 0: none, else scores become softcap * tanh(scores / softcap)
};

// Rows are cut into stretches of SPAN tokens (rounded up to whole blocks): a batch of one long
// row still keeps every thread busy, and ragged rows balance. The cut depends on nothing but the
// row's own length, so a row's result is the same in any batch and with any number of threads.
constexpr int64_t SPAN = 128;

struct Tasks {
  std::vector<int64_t> first;  // [B + 1]: row b owns tasks first[b] .. first[b + 1] - 1
  std::vector<int64_t> row;    // [tasks]: the task's row
  int64_t span_blocks = 1;
};

// firsts (or null: 0): each row's first key; its stretches start at that key's block.
Tasks plan_tasks(const Problem& P, const int32_t* lens, const int32_t* firsts) {
  Tasks T;
  T.span_blocks = (SPAN + P.block_size - 1) / P.block_size;
  T.first.reserve(P.rows + 1);
  T.first.push_back(0);
  for (int64_t b = 0; b < P.rows; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= P.max_blocks * P.block_size, "paged_decode: context_lens[", b,
                "] = ", lens[b], " outside [1, ", P.max_blocks * P.block_size, "]");
    TORCH_CHECK(!firsts || (firsts[b] >= 0 && firsts[b] < lens[b]), "paged_decode: first_keys[", b,
                "] outside [0, context_lens[", b, "])");
    const int64_t nblocks = (lens[b] + P.block_size - 1) / P.block_size - (firsts ? firsts[b] / P.block_size : 0);
    const int64_t parts = (nblocks + T.span_blocks - 1) / T.span_blocks;
    for (int64_t i = 0; i < parts; ++i) T.row.push_back(b);
    T.first.push_back(T.first.back() + parts);
  }
  return T;
}

// DC: head_dim when known at compile time (the common 64 and 128), 0 for any other.
// Writes the normalised output when the task covers its whole row; else the unnormalised
// acc [H, D], m [H] and l [H] of its stretch into `partial` (laid out [tasks, H, D + 2]).
template <typename T, int DC>
void stretch_task(const Problem& P, const Tasks& tasks, int64_t task, const T* q, const T* k, const T* v,
                  T* out, const int32_t* tables, const int32_t* lens, const int32_t* firsts, const int64_t* row_ids,
                  float* partial, std::vector<float>& scratch) {
  const int D = DC ? DC : static_cast<int>(P.head_dim);
  const int64_t H = P.heads, KVH = P.kv_heads, G = H / KVH, BS = P.block_size;
  const int64_t BSP = (BS + LANES - 1) / LANES * LANES;  // scores padded with -inf to whole lanes
  const int64_t b = tasks.row[task], part = task - tasks.first[b];
  const bool whole = tasks.first[b + 1] - tasks.first[b] == 1;
  const int64_t row = row_ids ? row_ids[b] : b;
  const int64_t len = lens[b];
  const int64_t first = firsts ? firsts[b] : 0;  // keys before it are masked (a sliding window)
  const int64_t j0 = first / BS + part * tasks.span_blocks;
  const int64_t j1 = std::min((len + BS - 1) / BS, j0 + tasks.span_blocks);

  // scratch: q (scaled, fp32) [H, D] | acc [H, D] | scores [GC_MAX, BSP] | m [H] | l [H] | q (bf16) [H, D]
  const int64_t token_stride = KVH * D;
  const int64_t gc_max = DC > 0 && DC % LANES == 0 ? heads_together(D) : 1;
  scratch.resize(2 * H * D + GC_MAX * BSP + 2 * H + (std::is_same_v<T, float> ? 0 : (H * D + 1) / 2));
  float* qf = scratch.data();
  float* acc = qf + H * D;
  float* s = acc + H * D;
  float* m = s + GC_MAX * BSP;
  float* l = m + H;
  c10::BFloat16* qb = std::is_same_v<T, float> ? nullptr : reinterpret_cast<c10::BFloat16*>(l + H);
  for (int64_t hq = 0; hq < H; ++hq) {
    const T* qh = q + row * P.q_row_stride + hq * P.q_head_stride;
    if constexpr (!std::is_same_v<T, float>) std::memcpy(qb + hq * D, qh, D * sizeof(T));
    for (int d = 0; d < D; ++d) qf[hq * D + d] = widen(qh[d]) * P.scale;
    m[hq] = -std::numeric_limits<float>::infinity();
    l[hq] = 0.0f;
  }
  std::fill(acc, acc + H * D, 0.0f);

  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = tables[b * P.max_blocks + j];
    TORCH_CHECK(blk >= 0 && blk < P.num_blocks, "paged_decode: block_tables[", b, ", ", j, "] = ", blk,
                " outside [0, ", P.num_blocks, ")");
    const int64_t n = std::min(BS, len - j * BS);
    const T* kb = k + blk * BS * token_stride;
    const T* vb = v + blk * BS * token_stride;
    Ahead ahead;
    if (j + 1 < j1) {
      const int64_t next = tables[b * P.max_blocks + j + 1];
      if (next >= 0 && next < P.num_blocks) {  // an invalid id fails its check on the next block
        ahead.k = reinterpret_cast<const char*>(k + next * BS * token_stride);
        ahead.v = reinterpret_cast<const char*>(v + next * BS * token_stride);
        ahead.bytes = std::min(BS, len - (j + 1) * BS) * token_stride * static_cast<int64_t>(sizeof(T));
        const int64_t steps = 2 * n * KVH * ((G + gc_max - 1) / gc_max);  // token loops over this block
        ahead.per_step = (ahead.bytes / 64 + steps - 1) / steps;
      }
    }
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t g0 = 0; g0 < G; g0 += gc_max) {
        const int gc = static_cast<int>(std::min<int64_t>(gc_max, G - g0));
        const int64_t hq0 = h * G + g0;
        with_heads(gc, [&](auto GCc) {
          group_scores<T, DC, GCc.value>(qf + hq0 * D, qb ? qb + hq0 * D : nullptr, P.scale, kb + h * D,
                                         token_stride, n, s, BSP, D, ahead);
        });
        for (int g = 0; g < gc; ++g) {
          const int64_t hq = hq0 + g;
          float* sg = s + g * BSP;
          if (P.softcap > 0.0f)
            for (int64_t t = 0; t < n; ++t) sg[t] = P.softcap * std::tanh(sg[t] / P.softcap);
          for (int64_t t = 0; t < first - j * BS && t < n; ++t) sg[t] = -std::numeric_limits<float>::infinity();
          for (int64_t t = n; t < BSP; ++t) sg[t] = -std::numeric_limits<float>::infinity();
          const float mb = max_of(sg, BSP);
          if (mb > m[hq]) {
            // exp(-inf) = 0 on the first block: acc and l are still 0, so nothing is lost.
            const float alpha = exp_nonpositive(m[hq] - mb);
            for (int d = 0; d < D; ++d) acc[hq * D + d] *= alpha;
            l[hq] *= alpha;
            m[hq] = mb;
          }
          l[hq] += exp_sum(sg, BSP, m[hq]);
        }
        with_heads(gc, [&](auto GCc) {
          group_accumulate<T, DC, GCc.value>(acc + hq0 * D, vb + h * D, token_stride, n, s, BSP, D, ahead);
        });
      }
    }
  }
  for (int64_t hq = 0; hq < H; ++hq) {
    if (whole) {
      T* oh = out + row * P.out_row_stride + hq * P.out_head_stride;
      const float inv = 1.0f / l[hq];
      for (int d = 0; d < D; ++d) oh[d] = static_cast<T>(acc[hq * D + d] * inv);
    } else {
      float* ph = partial + (task * H + hq) * (D + 2);
      std::memcpy(ph, acc + hq * D, D * sizeof(float));
      ph[D] = m[hq];
      ph[D + 1] = l[hq];
    }
  }
}

// out[row] from a split row's stretches: sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
template <typename T>
void merge_row(const Problem& P, const Tasks& tasks, int64_t b, const int64_t* row_ids, const float* partial,
               T* out, std::vector<float>& num) {
  const int64_t H = P.heads, D = P.head_dim;
  const int64_t row = row_ids ? row_ids[b] : b;
  for (int64_t hq = 0; hq < H; ++hq) {
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t t = tasks.first[b]; t < tasks.first[b + 1]; ++t) M = std::max(M, partial[(t * H + hq) * (D + 2) + D]);
    float den = 0.0f;
    num.assign(D, 0.0f);
    for (int64_t t = tasks.first[b]; t < tasks.first[b + 1]; ++t) {
      const float* ph = partial + (t * H + hq) * (D + 2);
      const float w = exp_nonpositive(ph[D] - M);
      den += w * ph[D + 1];
      for (int64_t d = 0; d < D; ++d) num[d] += w * ph[d];
    }
    T* oh = out + row * P.out_row_stride + hq * P.out_head_stride;
    for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<T>(num[d] / den);
  }
}

template <typename T, int DC>
void run(const Problem& P, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
         const at::Tensor& tables, const at::Tensor& lens, const at::Tensor* rows, const at::Tensor* firsts) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t* rp = rows ? rows->data_ptr<int64_t>() : nullptr;
  const int32_t* fp = firsts ? firsts->data_ptr<int32_t>() : nullptr;
  const Tasks tasks = plan_tasks(P, lp, fp);
  const int64_t ntasks = static_cast<int64_t>(tasks.row.size());
  const bool split = ntasks > P.rows;
  std::vector<float> partial(split ? ntasks * P.heads * (P.head_dim + 2) : 0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;)
      stretch_task<T, DC>(P, tasks, task, qp, kp, vp, op, tp, lp, fp, rp, partial.data(), scratch);
  });
  if (split) {
    at::parallel_for(0, P.rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> num;  // one per thread, not one allocation per head
      for (int64_t b = begin; b < end; ++b)
        if (tasks.first[b + 1] - tasks.first[b] > 1) merge_row<T>(P, tasks, b, rp, partial.data(), op, num);
    });
  }
}

template <typename T>
void dispatch_head_dim(const Problem& P, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor* rows,
                       const at::Tensor* firsts) {
  switch (P.head_dim) {
    case 64: return run<T, 64>(P, q, k, v, out, tables, lens, rows, firsts);
    case 128: return run<T, 128>(P, q, k, v, out, tables, lens, rows, firsts);
    default: return run<T, 0>(P, q, k, v, out, tables, lens, rows, firsts);
  }
}

// out [N, H, D] (written at rows only), q [N, H, D], k/v [NB, BS, KVH, D] contiguous,
// block_tables [B, max_blocks] int32, context_lens [B] int32, rows [B] int64 or None (= arange(B)),
// first_keys [B] int32 or None (= 0): row b attends keys first_keys[b] .. context_lens[b] - 1 only.
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, c10::optional<at::Tensor> rows,
                  double scale, c10::optional<at::Tensor> first_keys = c10::nullopt, double softcap = 0.0) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "paged_decode: shapes");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  out.scalar_type() == k.scalar_type(), "paged_decode: q, k, v, out must share one dtype");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "paged_decode: k/v cache must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_decode: q/out need a unit head_dim stride");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.dim() == 2,
              "paged_decode: block_tables [B, max_blocks] and context_lens [B] must be contiguous int32");
  Problem P;
  P.rows = block_tables.size(0);
  P.heads = q.size(1);
  P.kv_heads = k.size(2);
  P.head_dim = k.size(3);
  P.block_size = k.size(1);
  P.num_blocks = k.size(0);
  P.max_blocks = block_tables.size(1);
  P.q_row_stride = q.stride(0);
  P.q_head_stride = q.stride(1);
  P.out_row_stride = out.stride(0);
  P.out_head_stride = out.stride(1);
  P.scale = static_cast<float>(scale);
  P.softcap = static_cast<float>(softcap);
  TORCH_CHECK(q.size(2) == P.head_dim && out.size(1) == P.heads && out.size(2) == P.head_dim &&
                  P.heads % P.kv_heads == 0 && context_lens.numel() == P.rows,
              "paged_decode: q [N, H, D], k [NB, BS, KVH, D] with H % KVH == 0, context_lens [B]");
  const at::Tensor* row_ptr = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == P.rows,
                "paged_decode: rows must be a contiguous int64 [B]");
    const int64_t* r = rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < P.rows; ++i)
      TORCH_CHECK(r[i] >= 0 && r[i] < q.size(0) && r[i] < out.size(0), "paged_decode: rows[", i, "] out of range");
    row_ptr = &*rows;
  } else {
    TORCH_CHECK(q.size(0) >= P.rows && out.size(0) >= P.rows, "paged_decode: fewer q rows than block tables");
  }
  TORCH_CHECK(!first_keys.has_value() || (first_keys->scalar_type() == at::kInt && first_keys->is_contiguous() &&
                                            first_keys->numel() == P.rows),
              "paged_decode: first_keys must be a contiguous int32 [B]");
  const at::Tensor* first_ptr = first_keys.has_value() ? &*first_keys : nullptr;
  if (P.rows == 0) return;
  if (k.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(P, q, k, v, out, block_tables, context_lens, row_ptr, first_ptr);
  } else if (k.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<c10::BFloat16>(P, q, k, v, out, block_tables, context_lens, row_ptr, first_ptr);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only, got ", k.scalar_type());
  }
}

}  // namespace tessera_paged
