// Vector helpers shared by the CPU kernels of the decoder (paged attention, the elementwise glue, the
// decode stack, the few-row matmuls) and of the pooling service (encoder attention): the few-row matmuls' row
// dispatch, bf16 widening, a branch-free exp for non-positive arguments, 16-lane vectors (GCC/Clang vector
// extensions) and their reductions, a prefetch.
// Written for -march=native builds (services/common/native.py): intrinsics only where the CPU has them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace tessera_vec {

// The few-row matmuls (the decoder's gemv.h, gemv_bf16.h, gemv_grouped.h) keep the accumulators of PASS_ROWS rows of
// x in registers at once, and take up to MAX_ROWS rows a call: the rows past PASS_ROWS take each weight row again
// while it is in L1, so the weights are read from memory once, and each row's sums are those of its own one-row call.
constexpr int64_t PASS_ROWS = 4, MAX_ROWS = 2 * PASS_ROWS;

// f(std::integral_constant<int, M>) for the call's row count M in [1, MAX_ROWS] (the few-row matmuls', and the
// blocks of rows of the decoder's lora_rows.h): each kernel is a template on M, so its rows' accumulators are
// registers. who: the kernel's name for the refusal.
template <typename F>
inline void with_rows(int64_t M, const char* who, F&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: TORCH_CHECK(false, who, ": at most ", MAX_ROWS, " rows, got ", M);
  }
}

// The `bytes` at p + ahead asked into cache (ahead 0: nothing asked; the hardware prefetchers alone), for the
// few-row matmuls over weights streamed from memory (the decoder's gemv.h, gemv_bf16.h, gemv_grouped.h). Why: the
// more work per weight byte (more rows of x), the fewer cache lines the out-of-order window keeps in flight, so
// the stream slows as rows are added. On an Intel Xeon (family 6 model 207, 2 threads) a chain of 30 3072 x 576
// fp32 weights (212 MB) took 8.4 ms at one row and 10.8 at four; asked 8 KiB ahead, 4.7 and 5.2 ms. Whether it
// helps is timed at load (services/decoder/model/matmul_choice.py, the gemv_prefetch path). Call it from the code
// that reads the row, not from a helper that does nothing else: GCC 12 found such a lambda "locally const" (its
// local-pure-const pass: a prefetch writes nothing) and deleted every call to it, prefetches and all.
inline void prefetch_ahead(const void* p, int64_t ahead, int64_t bytes) {
  if (!ahead) return;
  const char* c = static_cast<const char*>(p) + ahead;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 3);
}

// The weight rows [n0, n1) of one thread's share, in the order a few-row matmul reads them: front to back
// (streams 1), or from the share's two halves in turn (streams 2: n0, n0 + h, n0 + 1, n0 + h + 1, ...), so that
// two streams from memory are in flight instead of one. Why: on an Intel Xeon (family 6 model 167, 2 threads) the
// kernels took a decode step's weights (SmolLM2's 121, asked 8 KiB ahead) at 32-34 GB/s in int8, 24-27 in bf16 and
// 28 in fp32 at one row of x, where a plain read of the same bytes ran 27-38; from two halves at 37-39, 29-30 and
// 29 (bf16 and fp32 at four rows: 20 -> 23). On Llama-3.2-1B's wider weights the same CPU's batch-1 decode was
// slower with two (0.87-0.93x), so which one runs is timed at load (services/decoder/model/matmul_choice.py, the
// gemv_streams path). Each row's sums are the same in either order.
template <typename F>
inline void each_weight_row(int64_t n0, int64_t n1, int64_t streams, F&& f) {
  if (streams < 2) {
    for (int64_t n = n0; n < n1; ++n) f(n);
    return;
  }
  const int64_t h = (n1 - n0 + 1) / 2;
  for (int64_t i = 0; i < h; ++i) {
    f(n0 + i);
    if (n0 + h + i < n1) f(n0 + h + i);
  }
}

constexpr int LANES = 16;  // partial sums per dot product: one 512-bit or two 256-bit registers

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their running max), branch-free so loops over it vectorise:
// x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (Cephes expf coefficients),
// 2^n through the exponent bits: within 1 ulp of exp on every float in [-87, 0]. Below -87
// (weights under 1.7e-38 of the largest) the result is exactly 0.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// 16 floats as one value (GCC/Clang vector extension): the compiler maps it onto whatever the
// build machine has (one zmm, two ymm, four xmm/NEON), so no intrinsics are needed, and arrays of
// them with constant indices stay in registers across a loop.
typedef float v16 __attribute__((vector_size(LANES * sizeof(float))));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

typedef uint16_t u16x16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t u32x16 __attribute__((vector_size(LANES * sizeof(uint32_t))));

#ifdef __AVX512F__
// GCC 12 splits the generic widening below into two 256-bit halves with extracts and inserts on a
// Zen 4 (it tunes for znver3 there); one zero-extending load and a shift made bf16 decode attention
// 12-16% faster (64 rows x 160 keys, 2 threads).
inline v16 load16(const c10::BFloat16* p) {
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}
#else
inline v16 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32: widen and shift
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  v16 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
#endif

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

inline float hsum(v16 x) {  // halving in registers: 4 dependent adds, not 15 through memory
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// n (a multiple of LANES) values: lane-wise max and sum in vectors, then one halving reduction.
inline float hmax(v16 x) {
  const v8 lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 a = lo < hi ? hi : lo;
  const v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const v4 e = c < d ? d : c;
  return std::max(std::max(e[0], e[1]), std::max(e[2], e[3]));
}

inline float max_of(const float* __restrict__ x, int64_t n) {
  v16 m = load16(x);
  for (int64_t t0 = LANES; t0 < n; t0 += LANES) {
    const v16 y = load16(x + t0);
    m = m < y ? y : m;
  }
  return hmax(m);
}

inline float exp_sum(float* __restrict__ x, int64_t n, float shift) {
  for (int64_t t = 0; t < n; ++t) x[t] = exp_nonpositive(x[t] - shift);
  v16 acc = load16(x);
  for (int64_t t0 = LANES; t0 < n; t0 += LANES) acc += load16(x + t0);
  return hsum(acc);
}

}  // namespace tessera_vec
