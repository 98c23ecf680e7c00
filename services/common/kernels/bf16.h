// fp32 -> bf16 rounding as the CPU kernels store it: round to nearest even, as c10::BFloat16 rounds (the values
// here are finite), one value or a vector of 16.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

namespace tessera_bf16 {

inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// v as T (float, or at::BFloat16 rounded as above).
template <typename T>
inline T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return c10::BFloat16(to_bf16_bits(v), c10::BFloat16::from_bits());
}

#ifdef __AVX512F__
// 16 fp32 lanes stored as 16 T at dst (unaligned).
template <typename T>
inline void store16(__m512 v, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, v);
  } else {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  }
}
#endif

}  // namespace tessera_bf16
