// The rows of x as the few-row grouped kernel (gemv_grouped.h) reads them: each row rounded to int8 per group of
// the weight's inputs (step max|group| / 127, ties to even: grouped.round_groups), laid out in the order of the
// weight's codes, with each group's step and step * sum(q).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TESSERA_GROUPED_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TESSERA_GROUPED_AVX2 1
#endif
#if defined(TESSERA_GROUPED_VNNI) || defined(TESSERA_GROUPED_AVX2)
#include <immintrin.h>
#endif

namespace tessera_grouped {

constexpr int64_t CHUNK = 64;     // bytes of codes per vector step
constexpr int64_t PAD = 8;        // zeros past XRow::s and sums, so a chunk's 8 groups can be read whole

// The shape of one weight: N rows of K inputs, groups of G, `bits` per code.
struct Shape {
  int64_t N, K, G, bits;
  int64_t row_bytes() const { return K * bits / 8; }
  // G and a group's bytes are powers of two (16 or 32 inputs of 4 or 8 bits): shifts, not the integer divisions
  // that took ~10% of a call where a loop divided once a chunk.
  int64_t groups() const { return K >> __builtin_ctzll(G); }
  int64_t group_bytes() const { return G * bits / 8; }
  int64_t groups_in(int64_t bytes) const { return bytes >> __builtin_ctzll(group_bytes()); }  // whole groups
};

// One row of x rounded per group: q int8 in the kernel's order (zero past the codes), step s[g] and
// sums[g] = s[g] * (sum of the group's q).
struct XRow {
  std::vector<int8_t> q;
  std::vector<float> s;
  std::vector<float> sums;
};

// One group of x rounded: q[i] for its G inputs; returns the sum of the q. Vectorised where the VNNI loop runs
// (the same division and rounding, nearest with ties to even, as the scalar loop): K scalar divisions per
// call on the caller's thread while the others wait were a tenth of a 2048 x 2048 call.
inline int32_t round_group(const float* xg, int64_t G, float step, int8_t* q) {
#ifdef TESSERA_GROUPED_VNNI
  const __m512 sv = _mm512_set1_ps(step), lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
  __m512i total = _mm512_setzero_si512();
  for (int64_t i = 0; i < G; i += 16) {
    const __m512i qi = _mm512_cvtps_epi32(
        _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(xg + i), sv), nlim), lim));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(qi));
    total = _mm512_add_epi32(total, qi);
  }
  return _mm512_reduce_add_epi32(total);
#elif defined(TESSERA_GROUPED_AVX2)
  const __m256 sv = _mm256_set1_ps(step), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
  __m256i total = _mm256_setzero_si256();
  for (int64_t i = 0; i < G; i += 8) {
    const __m256i qi = _mm256_cvtps_epi32(
        _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(xg + i), sv), nlim), lim));
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w16, w16));
    total = _mm256_add_epi32(total, qi);
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
#else
  int32_t total = 0;
  for (int64_t i = 0; i < G; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(std::clamp(xg[i] / step, -127.0f, 127.0f)));
    total += q[i];
  }
  return total;
#endif
}

// XRow::q's order. 8-bit: input k at k. 4-bit: group g's bytes are b = g * G / 2 .. + G / 2 - 1 (a run within
// one CHUNK, since G / 2 divides it); the inputs of their low nibbles (the group's first half) go to the
// chunk's first CHUNK bytes of q, at b % CHUNK, those of their high nibbles (second half) to the next CHUNK.
inline void round_row(const float* x, const Shape& sh, XRow& r) {
  const int64_t chunks = (sh.row_bytes() + CHUNK - 1) / CHUNK;
  r.q.assign(chunks * CHUNK * (sh.bits == 4 ? 2 : 1), 0);
  r.s.assign(sh.groups() + PAD, 0.0f);
  r.sums.assign(sh.groups() + PAD, 0.0f);
  const int64_t G = sh.G, half = G / 2;
  int8_t q[32];
  for (int64_t g = 0; g < sh.groups(); ++g) {
    const float* xg = x + g * G;
    float amax = 0.0f;
    // A max is the same in any order; without the reduction clause GCC ran it one float at a time.
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < G; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float step = amax > 0.0f ? amax / 127.0f : 1.0f;
    const int32_t total = round_group(xg, G, step, q);
    if (sh.bits == 8) {
      std::memcpy(r.q.data() + g * G, q, G);
    } else {
      const int64_t b = g * half, base = (b / CHUNK) * 2 * CHUNK + b % CHUNK;
      std::memcpy(r.q.data() + base, q, half);
      std::memcpy(r.q.data() + base + CHUNK, q + half, half);
    }
    r.s[g] = step;
    r.sums[g] = step * static_cast<float>(total);
  }
}

}  // namespace tessera_grouped
