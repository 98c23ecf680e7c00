// Few-row matmul over grouped weights (services/decoder/model/grouped.py): y[m, n] = sum_k x[m, k] * w[n, k]
// (+ bias[n]) with w[n, k] = scale[n, g] * code[n, k] + offset[n, g], g = k / G, codes of 4 or 8 bits.
//
// A decode step of a few rows reads every weight once, so its time is the bytes read: 4-bit codes are a
// quarter of bf16's. Widening each code to fp32 for an FMA would cost more vector ops per byte than the
// memory delivers (the int8 path measured that, gemv.h's dispatch_q8), so, as there, x is rounded to int8
// per group of G inputs (step max|group| / 127, ties to even: grouped.round_groups) and the CPU's byte dot
// product (AVX512-VNNI's vpdpbusd: unsigned codes times signed x, four products a 32-bit lane) sums the
// codes against it exactly in int32. Per group:
//     sum_k x_k w_k = s_x * (scale * (q . code) + offset * sum(q)),
// with s_x * sum(q) computed once per row of x and group.
//
// Layout (grouped.py): a 4-bit group is G / 2 bytes, byte j holding code j (low nibble) and code j + G / 2
// (high nibble). A 64-byte vector of codes is then 128 / G whole groups; its low nibbles are the first
// halves of those groups, its high nibbles the second halves. x is rearranged once per row into that
// order (XRow), so one AND, one shift and two dot products take 128 codes. Each 32-bit lane of the dot
// product belongs to one group; the lanes are scaled by their group's scale * s_x in fp32 and summed.
//
// A row's sums are the same whatever the other rows of x in the call and wherever the threads split the
// weight rows (every row of x runs the same loop over each weight row). Without AVX512-VNNI, on AVX2 CPUs
// (Zen 2, Zen 3, older Xeons), a 256-bit loop does the same with vpmaddubsw (pairs of byte products summed in 16
// bits) and vpmaddwd (to 32-bit lanes); elsewhere a portable loop. The VNNI loop and the AVX2 one each come in
// two orders of work (`pairs`, `chunks`), timed against each other at load (model/matmul_choice.py). Each sums in
// its own order; which one runs is `Loop` (tests run every one the CPU has).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../../common/kernels/vec.h"
#include "grouped_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tessera_grouped {

using tessera_vec::MAX_ROWS;    // rows of x per call (gemv_grouped_cpu.MAX_ROWS), PASS_ROWS of them a pass
using tessera_vec::PASS_ROWS;

// The loops (gemv_grouped_cpu.LOOPS' indices): the two AVX512-VNNI loops, `pairs` and `chunks` (where the CPU lacks
// VNNI, the AVX2 loop's two-chunk and one-chunk orders, or else the portable loop), the AVX2 loop (one chunk a
// step), the portable one, the AVX2 loop in two-chunk steps.
enum class Loop : int64_t { pairs = 0, avx2 = 1, portable = 2, chunks = 3, avx2_pairs = 4 };

inline bool runs(Loop loop) {
  switch (loop) {
    case Loop::pairs:
    case Loop::chunks:
    case Loop::portable:
      return true;
    case Loop::avx2:
    case Loop::avx2_pairs:
#ifdef TESSERA_GROUPED_AVX2
      return true;
#else
      return false;
#endif
  }
  return false;
}

template <typename F>
inline void with_rows(int64_t M, F&& f) { tessera_vec::with_rows(M, "gemv_grouped", f); }

inline float half_to_float(const at::Half* p) { return static_cast<float>(*p); }

#ifdef TESSERA_GROUPED_VNNI
// Lane l (32 bits, bytes 4l .. 4l + 3 of a chunk) of the dot product belongs to group 4l / group_bytes of
// the chunk: the index vector that spreads the chunk's per-group factors over its lanes.
inline __m512i lane_groups(int64_t group_bytes) {
  alignas(64) int32_t idx[16];
  for (int l = 0; l < 16; ++l) idx[l] = static_cast<int32_t>(4 * l / group_bytes);
  return _mm512_load_si512(idx);
}

// One chunk of codes against x's bytes for it (q: the chunk's XRow::q): the int32 lanes of the dot product.
template <int BITS>
__attribute__((always_inline)) inline __m512i chunk_dot(__m512i raw, const int8_t* q) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  if constexpr (BITS == 4) {
    const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(raw, low), _mm512_loadu_si512(q));
    return _mm512_dpbusd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low), _mm512_loadu_si512(q + CHUNK));
  } else {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), raw, _mm512_loadu_si512(q));
  }
}

// The `pairs` loop: acc[m, n] for M rows of x against weight row n. Codes are read two chunks (128 bytes) at a
// time: the pair's groups (at most 16) have their scales widened in one conversion and multiplied by x's steps
// once, then spread over each chunk's lanes; the offsets' term (sum over groups of offset * sums) is a pass of
// its own, 16 groups a vector, after the codes. Fewer vector ops a byte than `chunks`: on a Zen 4 a 1 B-shaped
// int4 pass ran 1.15x faster on one thread (bench/figures/widen_gemm_zen4.txt). A row's last chunk, when the row
// has an odd count or a short one, runs alone. A full chunk's group count is per_chunk, not a division: two
// integer divisions per chunk took ~10% of a 2048 x 2048 call.
template <int M, int BITS>
inline void row_pairs(const XRow* xr, const uint8_t* wn, const at::Half* sn, const at::Half* on, const Shape& sh,
                      __m512i spread, int64_t n, float* acc) {
  constexpr int64_t QC = CHUNK * (BITS == 4 ? 2 : 1);  // bytes of XRow::q a chunk of codes takes
  const int64_t bytes = sh.row_bytes(), ng = sh.groups();
  const int64_t per_chunk = sh.groups_in(CHUNK);  // groups a chunk holds (2, 4 or 8)
  const __m512i spread1 = _mm512_add_epi32(spread, _mm512_set1_epi32(static_cast<int32_t>(per_chunk)));
  const __mmask16 pair_mask = static_cast<__mmask16>((1u << (2 * per_chunk)) - 1);
  __m512 a[M];
  for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; (c + 2) * CHUNK <= bytes; c += 2) {
    const int64_t g0 = c * per_chunk;
    const __m512i r0 = _mm512_loadu_si512(wn + c * CHUNK), r1 = _mm512_loadu_si512(wn + (c + 1) * CHUNK);
    const __m512 sw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(pair_mask, sn + g0));
    for (int m = 0; m < M; ++m) {
      const int8_t* q = xr[m].q.data() + c * QC;
      const __m512 f = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(pair_mask, xr[m].s.data() + g0));
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_dot<BITS>(r0, q)), _mm512_permutexvar_ps(spread, f), a[m]);
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_dot<BITS>(r1, q + QC)), _mm512_permutexvar_ps(spread1, f),
                             a[m]);
    }
  }
  for (; c * CHUNK < bytes; ++c) {
    const int64_t left = bytes - c * CHUNK, g0 = c * per_chunk;
    const __mmask64 bmask = left >= CHUNK ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    const __mmask16 gmask = static_cast<__mmask16>((1u << (left >= CHUNK ? per_chunk : sh.groups_in(left))) - 1);
    const __m512i raw = _mm512_maskz_loadu_epi8(bmask, wn + c * CHUNK);
    const __m512 sw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gmask, sn + g0));
    for (int m = 0; m < M; ++m) {
      const __m512 f = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(gmask, xr[m].s.data() + g0));
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_dot<BITS>(raw, xr[m].q.data() + c * QC)),
                             _mm512_permutexvar_ps(spread, f), a[m]);
    }
  }
  __m512 off[M];
  for (int m = 0; m < M; ++m) off[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; g += 16) {
    const __mmask16 gmask = ng - g >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (ng - g)) - 1);
    const __m512 ow = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gmask, on + g));
    for (int m = 0; m < M; ++m)
      off[m] = _mm512_fmadd_ps(ow, _mm512_maskz_loadu_ps(gmask, xr[m].sums.data() + g), off[m]);
  }
  for (int m = 0; m < M; ++m) acc[m * sh.N + n] = _mm512_reduce_add_ps(a[m]) + _mm512_reduce_add_ps(off[m]);
}

// The `chunks` loop: acc[m, n] one chunk of 64 bytes at a time, the offsets' term inside it (the loop before
// `pairs`, kept for CPUs where it is the faster: the plan times both at load).
template <int M, int BITS>
inline void row_chunks(const XRow* xr, const uint8_t* wn, const at::Half* sn, const at::Half* on, const Shape& sh,
                       __m512i spread, int64_t n, float* acc) {
  const int64_t bytes = sh.row_bytes();
  const int64_t per_chunk = sh.groups_in(CHUNK);  // groups a chunk holds (2, 4 or 8)
  __m512 a[M];
  __m256 off[M];
  for (int m = 0; m < M; ++m) {
    a[m] = _mm512_setzero_ps();
    off[m] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c * CHUNK < bytes; ++c) {
    const int64_t left = bytes - c * CHUNK;
    const __mmask64 bmask = left >= CHUNK ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    const int64_t g0 = c * per_chunk;
    const __mmask8 gmask = static_cast<__mmask8>((1u << (left >= CHUNK ? per_chunk : sh.groups_in(left))) - 1);
    const __m512i raw = _mm512_maskz_loadu_epi8(bmask, wn + c * CHUNK);
    const __m256 sw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(gmask, sn + g0));
    const __m256 ow = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(gmask, on + g0));
    for (int m = 0; m < M; ++m) {
      const __m512i d = chunk_dot<BITS>(raw, xr[m].q.data() + c * CHUNK * (BITS == 4 ? 2 : 1));
      const __m256 sx = _mm256_maskz_loadu_ps(gmask, xr[m].s.data() + g0);
      const __m512 f = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_mul_ps(sw, sx)));
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), f, a[m]);
      off[m] = _mm256_fmadd_ps(ow, _mm256_maskz_loadu_ps(gmask, xr[m].sums.data() + g0), off[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 o4 = _mm_add_ps(_mm256_castps256_ps128(off[m]), _mm256_extractf128_ps(off[m], 1));
    __m128 o2 = _mm_add_ps(o4, _mm_movehl_ps(o4, o4));
    o2 = _mm_add_ss(o2, _mm_movehdup_ps(o2));
    acc[m * sh.N + n] = _mm512_reduce_add_ps(a[m]) + _mm_cvtss_f32(o2);
  }
}
#endif

#ifdef TESSERA_GROUPED_AVX2
// One 32-byte half h of chunk c in 8 lanes (lane l: bytes 32 h + 4 l .. + 3, as the VNNI loop's lanes).
// vpmaddubsw sums two products in 16 bits with saturation: 4-bit codes (<= 15) times |q| <= 127 keep four
// products (lo and hi nibbles' pairs added) exact; an 8-bit code is taken as 16 * high nibble + low nibble.
template <int BITS>
__attribute__((always_inline)) inline __m256i dot_half(const uint8_t* w, const int8_t* q) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  if constexpr (BITS == 4) {
    const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + CHUNK));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
  } else {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xv), ones);
    const __m256i h = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xv), ones);
    return _mm256_add_epi32(l, _mm256_slli_epi32(h, 4));
  }
}

// The chunk's group of lane L of hadd(d0, d1), d0 and d1 the dot products of its two halves: hadd sums lane
// pairs within each 128-bit half, so lane L = 4 p + i sums lanes 4 p + 2 (i % 2) and + 1 of half i / 2, bytes
// 32 (i / 2) + 4 (4 p + 2 (i % 2)) .. + 7 of the chunk (one group: a group is at least 8 bytes).
inline __m256i lane_groups_avx2(int64_t group_bytes) {
  alignas(32) int32_t idx[8];
  for (int L = 0; L < 8; ++L) {
    const int p = L / 4, i = L % 4;
    idx[L] = static_cast<int32_t>((32 * (i / 2) + 4 * (4 * p + 2 * (i % 2))) / group_bytes);
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
}

// 8 fp16 values from p widened to fp32 (exactly), never reading past p + readable (zeros there).
inline __m256 load8_half(const at::Half* p, int64_t readable) {
  if (readable >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t part[8] = {};
  std::memcpy(part, p, sizeof(uint16_t) * readable);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(part)));
}

// Chunk c of weight row wn against the M rows of x, into their lanes of a (codes) and off (offsets). Each chunk
// reads 8 scales and offsets from its first group, widened as they are read: past the row's groups that is the
// next row's (unused: spread never picks them, and the offsets' lanes past a chunk's groups are masked off, their
// sums being another chunk's), and past the last row's, zeros (readable: the fp16 values readable from the row's
// first scale on).
template <int M, int BITS>
__attribute__((always_inline)) inline void chunk_avx2(const XRow* xr, const uint8_t* wn, const at::Half* sn,
                                                      const at::Half* on, const Shape& sh, __m256i spread,
                                                      int64_t readable, int64_t c, __m256* a, __m256* off) {
  const int64_t bytes = sh.row_bytes(), per_chunk = sh.groups_in(CHUNK);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t left = std::min(CHUNK, bytes - c * CHUNK), g0 = c * per_chunk;
  const uint8_t* w = wn + c * CHUNK;
  __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(per_chunk)), lanes));
  int halves = 2;
  alignas(32) uint8_t tail[CHUNK];
  if (left < CHUNK) {  // the row's last, short chunk
    keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(sh.groups_in(left))), lanes));
    if (left == CHUNK / 2) {
      halves = 1;  // one whole half: the other's sums would be zero
    } else {  // zeros past it (x is zero there too)
      std::memset(tail, 0, CHUNK);
      std::memcpy(tail, w, left);
      w = tail;
    }
  }
  const __m256 sw = load8_half(sn + g0, readable - g0);
  const __m256 ow = _mm256_and_ps(load8_half(on + g0, readable - g0), keep);
  for (int m = 0; m < M; ++m) {
    const int8_t* q = xr[m].q.data() + c * CHUNK * (BITS == 4 ? 2 : 1);
    const __m256 f = _mm256_mul_ps(sw, _mm256_loadu_ps(xr[m].s.data() + g0));
    // The two halves' lanes summed in pairs first, in int32 (exact), so one conversion and one FMA take the
    // chunk: on a Zen 2 the float work per chunk, not the bytes, set the pace.
    const __m256i d = _mm256_hadd_epi32(dot_half<BITS>(w, q),
                                        halves == 2 ? dot_half<BITS>(w + 32, q + 32) : _mm256_setzero_si256());
    a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(f, spread), a[m]);
    off[m] = _mm256_fmadd_ps(ow, _mm256_loadu_ps(xr[m].sums.data() + g0), off[m]);
  }
}

// acc[m, n] = the sum of the lanes of a[m] and off[m].
template <int M>
inline void store_rows_avx2(const __m256* a, const __m256* off, const Shape& sh, int64_t n, float* acc) {
  for (int m = 0; m < M; ++m) {
    const __m256 v = _mm256_add_ps(a[m], off[m]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    acc[m * sh.N + n] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
}

// The AVX2 loop in one-chunk steps (`chunks`, and `avx2`).
template <int M, int BITS>
inline void row_avx2(const XRow* xr, const uint8_t* wn, const at::Half* sn, const at::Half* on, const Shape& sh,
                     __m256i spread, int64_t n, float* acc) {
  __m256 a[M], off[M];
  for (int m = 0; m < M; ++m) a[m] = off[m] = _mm256_setzero_ps();
  const int64_t readable = (sh.N - n) * sh.groups();
  for (int64_t c = 0; c * CHUNK < sh.row_bytes(); ++c)
    chunk_avx2<M, BITS>(xr, wn, sn, on, sh, spread, readable, c, a, off);
  store_rows_avx2<M>(a, off, sh, n, acc);
}

// The chunk pair's group of lane L of hadd(hadd(d0, d1), hadd(d2, d3)), d0 .. d3 the dot products of its four
// 32-byte quarters: lane L = 4 p + i sums lanes 4 p .. 4 p + 3 of quarter i, bytes 32 i + 16 p .. + 15 of the
// pair, one group where a group is 16 or 32 bytes.
inline __m256i pair_groups_avx2(int64_t group_bytes) {
  alignas(32) int32_t idx[8];
  for (int L = 0; L < 8; ++L) idx[L] = static_cast<int32_t>((32 * (L % 4) + 16 * (L / 4)) / group_bytes);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
}

// The AVX2 loop in two-chunk steps (`pairs` on CPUs without AVX512-VNNI, and `avx2_pairs`), for groups of 16 or
// 32 bytes: the pair's four quarters reduced to one group a lane by three horizontal adds, so one conversion, one
// multiply of scales and one FMA take 128 bytes of codes, against two of each (and two of the offsets' terms) in
// one-chunk steps; the offsets' term is a pass of its own, 8 groups a vector, after the codes. The rest of a row
// shorter than a pair runs one-chunk steps.
template <int M, int BITS>
inline void row_avx2_pairs(const XRow* xr, const uint8_t* wn, const at::Half* sn, const at::Half* on,
                           const Shape& sh, __m256i spread, __m256i pair_spread, int64_t n, float* acc) {
  constexpr int64_t QC = CHUNK * (BITS == 4 ? 2 : 1);  // bytes of XRow::q a chunk of codes takes
  const int64_t bytes = sh.row_bytes(), ng = sh.groups(), per_pair = sh.groups_in(2 * CHUNK);
  const int64_t readable = (sh.N - n) * ng;
  __m256 a[M], off[M];
  for (int m = 0; m < M; ++m) a[m] = off[m] = _mm256_setzero_ps();
  int64_t c = 0, g0 = 0;
  for (; (c + 2) * CHUNK <= bytes; c += 2, g0 += per_pair) {
    const uint8_t* w = wn + c * CHUNK;
    const __m256 sw = _mm256_permutevar8x32_ps(load8_half(sn + g0, readable - g0), pair_spread);
    for (int m = 0; m < M; ++m) {
      const int8_t* q = xr[m].q.data() + c * QC;
      const __m256i d01 = _mm256_hadd_epi32(dot_half<BITS>(w, q), dot_half<BITS>(w + 32, q + 32));
      const __m256i d23 = _mm256_hadd_epi32(dot_half<BITS>(w + 64, q + QC), dot_half<BITS>(w + 96, q + QC + 32));
      const __m256 f = _mm256_mul_ps(sw, _mm256_permutevar8x32_ps(_mm256_loadu_ps(xr[m].s.data() + g0), pair_spread));
      a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(d01, d23)), f, a[m]);
    }
  }
  for (int64_t g = 0; g < g0; g += 8) {  // the offsets of the pairs' groups (the rest are chunk_avx2's)
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(g0 - g)), lanes));
    const __m256 ow = _mm256_and_ps(load8_half(on + g, readable - g), keep);
    for (int m = 0; m < M; ++m) off[m] = _mm256_fmadd_ps(ow, _mm256_loadu_ps(xr[m].sums.data() + g), off[m]);
  }
  for (; c * CHUNK < bytes; ++c) chunk_avx2<M, BITS>(xr, wn, sn, on, sh, spread, readable, c, a, off);
  store_rows_avx2<M>(a, off, sh, n, acc);
}
#endif

// The portable loop: per group, s_w * s_x * (q . code) + o_w * sums, codes read in XRow's order.
template <int M>
inline void row_portable(const XRow* xr, const uint8_t* wn, const at::Half* sn, const at::Half* on, const Shape& sh,
                         int64_t n, float* acc) {
  const int64_t gb = sh.group_bytes();
  for (int m = 0; m < M; ++m) {
    float total = 0.0f;
    for (int64_t g = 0; g < sh.groups(); ++g) {
      int32_t d = 0;
      for (int64_t b = g * gb; b < (g + 1) * gb; ++b) {
        const int64_t base = sh.bits == 4 ? (b / CHUNK) * 2 * CHUNK + b % CHUNK : b;
        if (sh.bits == 4) {
          d += static_cast<int32_t>(wn[b] & 0x0F) * xr[m].q[base] + static_cast<int32_t>(wn[b] >> 4) * xr[m].q[base + CHUNK];
        } else {
          d += static_cast<int32_t>(wn[b]) * xr[m].q[base];
        }
      }
      // Explicit FMAs: left to -ffp-contract, the compiler contracts differently per M, and a row's sum would
      // depend on the rows beside it.
      total = std::fma(half_to_float(sn + g) * xr[m].s[g], static_cast<float>(d), total);
      total = std::fma(half_to_float(on + g), xr[m].sums[g], total);
    }
    acc[m * sh.N + n] = total;
  }
}

template <int M>
void run(const float* x, const uint8_t* codes, const at::Half* scale, const at::Half* offset, const float* bias,
         float* y, const Shape& sh, Loop loop, int64_t ahead, int64_t streams) {
  // The caller's thread's buffers, kept between calls; the workers read them through this pointer.
  static thread_local XRow mine[MAX_ROWS];
  const XRow* xr = mine;
  for (int m = 0; m < M; ++m) round_row(x + m * sh.K, sh, mine[m]);
  const int64_t rb = sh.row_bytes(), ng = sh.groups();
#ifdef TESSERA_GROUPED_VNNI
  const __m512i spread = lane_groups(sh.group_bytes());
#endif
#ifdef TESSERA_GROUPED_AVX2
  const __m256i spread2 = lane_groups_avx2(sh.group_bytes()), pair_spread = pair_groups_avx2(sh.group_bytes());
#endif
  // The row `ahead` bytes of codes further on, with its scales and offsets, is asked for as each row starts
  // (tessera_vec::prefetch_ahead), whichever loop reads the row.
  const int64_t rows_ahead = ahead ? std::max<int64_t>(1, ahead / rb) : 0;
  at::parallel_for(0, sh.N, 64, [&](int64_t n0, int64_t n1) {
    // Weight row n against the R rows of x at xq, into their rows of out.
    auto pass = [&](auto R, const XRow* xq, float* out, int64_t n, const uint8_t* wn, const at::Half* sn,
                    const at::Half* on) {
      constexpr int P = decltype(R)::value;
#ifdef TESSERA_GROUPED_VNNI
      if (loop == Loop::pairs) {
        if (sh.bits == 4) row_pairs<P, 4>(xq, wn, sn, on, sh, spread, n, out);
        else row_pairs<P, 8>(xq, wn, sn, on, sh, spread, n, out);
        return;
      }
      if (loop == Loop::chunks) {
        if (sh.bits == 4) row_chunks<P, 4>(xq, wn, sn, on, sh, spread, n, out);
        else row_chunks<P, 8>(xq, wn, sn, on, sh, spread, n, out);
        return;
      }
#endif
#ifdef TESSERA_GROUPED_AVX2
      // Without AVX512-VNNI, `pairs` is the AVX2 loop's two-chunk order (where groups are 16 or 32 bytes)
      if ((loop == Loop::avx2_pairs || loop == Loop::pairs) && sh.group_bytes() >= 16) {
        if (sh.bits == 4) row_avx2_pairs<P, 4>(xq, wn, sn, on, sh, spread2, pair_spread, n, out);
        else row_avx2_pairs<P, 8>(xq, wn, sn, on, sh, spread2, pair_spread, n, out);
        return;
      }
      if (loop != Loop::portable) {
        if (sh.bits == 4) row_avx2<P, 4>(xq, wn, sn, on, sh, spread2, n, out);
        else row_avx2<P, 8>(xq, wn, sn, on, sh, spread2, n, out);
        return;
      }
#endif
      row_portable<P>(xq, wn, sn, on, sh, n, out);
    };
    tessera_vec::each_weight_row(n0, n1, streams, [&](int64_t n) {
      const uint8_t* wn = codes + n * rb;
      const at::Half* sn = scale + n * ng;
      const at::Half* on = offset + n * ng;
      tessera_vec::prefetch_ahead(wn, rows_ahead * rb, rb);
      tessera_vec::prefetch_ahead(sn, rows_ahead * ng * 2, ng * 2);
      tessera_vec::prefetch_ahead(on, rows_ahead * ng * 2, ng * 2);
      pass(std::integral_constant<int, std::min<int>(M, PASS_ROWS)>{}, xr, y, n, wn, sn, on);
      // The rows past PASS_ROWS take the weight row again, from L1 (vec.h).
      if constexpr (M > PASS_ROWS)
        pass(std::integral_constant<int, M - PASS_ROWS>{}, xr + PASS_ROWS, y + PASS_ROWS * sh.N, n, wn, sn, on);
    });
    if (bias)
      for (int m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * sh.N + n] += bias[n];
  });
}

// out [M, N] = x [M, K] @ w^T (+ bias [N] fp32), w given by codes uint8 [N, K * bits / 8] and scale, offset fp16
// [N, K / group] (grouped.py's layout). x and out are both float32 or both bfloat16: bf16 x is widened once and
// the fp32 result rounded once into out. loop: a Loop's value; tests run the narrower loops where a wider one
// runs (they are what CPUs without it run). ahead: run's prefetch distance in bytes (0: none); streams: 1 or 2,
// tessera_vec::each_weight_row's.
void gemv_grouped(torch::Tensor out, torch::Tensor x, torch::Tensor codes, torch::Tensor scale, torch::Tensor offset,
                  int64_t bits, int64_t group, c10::optional<torch::Tensor> bias, int64_t loop_index, int64_t ahead,
                  int64_t streams) {
  TORCH_CHECK(ahead >= 0, "gemv_grouped: ahead must be >= 0, got ", ahead);
  TORCH_CHECK(streams == 1 || streams == 2, "gemv_grouped: streams must be 1 or 2, got ", streams);
  TORCH_CHECK(loop_index >= 0 && loop_index <= 4, "gemv_grouped: loop must be 0 to 4, got ", loop_index);
  const Loop loop = static_cast<Loop>(loop_index);
  TORCH_CHECK(runs(loop), "gemv_grouped: this CPU does not run the AVX2 loops");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && out.dim() == 2, "gemv_grouped: x, codes and out must be 2-D");
  TORCH_CHECK(bits == 4 || bits == 8, "gemv_grouped: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group == 16 || group == 32, "gemv_grouped: group must be 16 or 32, got ", group);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % group == 0, "gemv_grouped: group ", group, " does not divide K ", K);
  const Shape sh{N, K, group, bits};
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) == sh.row_bytes(),
              "gemv_grouped: codes must be uint8 [N, ", sh.row_bytes(), "]");
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 2 && t->size(0) == N && t->size(1) == sh.groups() &&
                t->is_contiguous(), "gemv_grouped: scale and offset must be float16 [N, ", sh.groups(), "]");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "gemv_grouped: out must be [", M, ", ", N, "]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && out.scalar_type() == x.scalar_type(),
              "gemv_grouped: x and out must both be float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && out.is_contiguous(),
              "gemv_grouped: tensors must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !codes.is_cuda(), "gemv_grouped: CPU tensors only");
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "gemv_grouped: at most ", MAX_ROWS, " rows, got ", M);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "gemv_grouped: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  std::vector<float> xs, ys;
  const float* xp;
  float* yp;
  if (bf16) {
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    xs.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xs[i] = static_cast<float>(xb[i]);
    ys.resize(M * N);
    xp = xs.data();
    yp = ys.data();
  } else {
    xp = x.data_ptr<float>();
    yp = out.data_ptr<float>();
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  const at::Half* op = offset.data_ptr<at::Half>();
  with_rows(M, [&](auto R) { run<R.value>(xp, cp, sp, op, bp, yp, sh, loop, ahead, streams); });
  if (bf16) {
    at::BFloat16* ob = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) ob[i] = at::BFloat16(ys[i]);
  }
}

}  // namespace tessera_grouped
