// The rounding of an activation row to int8 for the few-row kernel's int8 weights (gemv.h's dispatch_q8): x in
// blocks of QBLOCK inputs, each at its own scale, in the layout the CPU's int8 dot product reads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace tessera_gemv {

// int8 weights: x rounded to int8 in blocks of QBLOCK inputs (each block's scale max|x| / 127, as
// llama.cpp's Q8_0 does with the activations of its Q8_0 weights), the products summed exactly in
// int32 per block, the blocks' sums in fp32. Against widening each weight to fp32 (three vector ops
// per 16 weights, which left batch-1 int8 steps compute-bound at ~19 GB/s on a Zen 4), the CPU's
// int8 dot product does 64 per instruction. The rounding of x is at most max|block| / 254 per value,
// about bf16's unit roundoff relative to the block's largest value.
constexpr int64_t QBLOCK = 32;
constexpr int64_t QCHUNK = 64;  // inputs per vector step; rows are padded to a whole number of them

// One row of x, rounded: q [Kp] int8 (zero past K), and per group of 4 inputs (one int32 lane of the dot
// product) corr = -128 * their sum and s = their block's scale; Kp = K rounded up to QCHUNK.
struct QuantRow {
  std::vector<int8_t> q;
  std::vector<int32_t> corr;
  std::vector<float> s;
};

inline void quantize_row(const float* x, int64_t K, QuantRow& r) {
  const int64_t Kp = (K + QCHUNK - 1) / QCHUNK * QCHUNK;
  r.q.assign(Kp, 0);
  r.corr.assign(Kp / 4, 0);
  r.s.assign(Kp / 4, 0.0f);
  int64_t b0 = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // Whole blocks in two vectors each: the same division and rounding (nearest, ties to even: the
  // default mode) as the scalar loop below, whose K scalar divisions per call run on the caller's
  // thread while the others wait.
  const __m512i ones = _mm512_set1_epi8(1);
  for (; b0 + QBLOCK <= K; b0 += QBLOCK) {
    const __m512 lo = _mm512_loadu_ps(x + b0), hi = _mm512_loadu_ps(x + b0 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m512 sv = _mm512_set1_ps(scale), lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(lo, sv), nlim), lim));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(hi, sv), nlim), lim));
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(qlo)),
                                              _mm512_cvtsepi32_epi8(qhi), 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + b0), q);
    // Each group of 4: -128 * its sum (the dot product of 1s with q, shifted and negated).
    const __m256i sums = _mm512_castsi512_si256(
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_castsi256_si512(q)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.corr.data() + b0 / 4),
                        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7)));
    _mm256_storeu_ps(r.s.data() + b0 / 4, _mm256_set1_ps(scale));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The same in four 8-lane vectors per block (the AVX2 row_q8 reads no corr).
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (; b0 + QBLOCK <= K; b0 += QBLOCK) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b0 + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m256 sv = _mm256_set1_ps(scale), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)
      qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[i], sv), nlim), lim));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + b0), _mm256_permutevar8x32_epi32(packed, order));
    _mm256_storeu_ps(r.s.data() + b0 / 4, sv);
  }
#endif
  for (; b0 < K; b0 += QBLOCK) {
    const int64_t n = std::min(QBLOCK, K - b0);
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[b0 + i]));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int64_t i = 0; i < n; ++i)
      r.q[b0 + i] = static_cast<int8_t>(std::nearbyint(std::clamp(x[b0 + i] / scale, -127.0f, 127.0f)));
    for (int64_t j = b0 / 4; j < (b0 + n + 3) / 4; ++j) {
      r.s[j] = scale;
      r.corr[j] = -128 * (r.q[4 * j] + r.q[4 * j + 1] + r.q[4 * j + 2] + r.q[4 * j + 3]);
    }
  }
}

}  // namespace tessera_gemv
