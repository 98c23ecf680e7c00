// The elementwise glue between a decoder layer's matmuls, one pass per op over many rows: the CPU kernel.
// The launchers, their semantics and the torch references are in glue_cpu.py; decode_stack_cpu.cpp runs
// the same row functions inside its few-row decode steps.
//
// In torch an RMSNorm is six ops (widen, square, mean, rsqrt, two products, narrow) and SiLU(gate) * up
// two passes over strided halves of the gate|up matmul's output. With a bf16 matmul on AMX, a 2,048-row
// SmolLM2 prefill layer spent 4.5 ms in those two passes against 5.8 ms in the gate|up matmul itself
// (Intel Xeon, family 6 model 167, 2 threads). Here each op reads its inputs once and writes once.
//
// In bfloat16 each value is rounded wherever the torch path stores a bf16 tensor (after the norm's
// product, the SiLU, the product with up, the residual add), so the results track that path; the
// norm's sum of squares is fp32 in both.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../common/kernels/vec.h"

namespace tessera_glue {

using tessera_vec::widen;

// v rounded to the nearest bf16, ties to even, NaN kept NaN: c10::BFloat16's rounding bit for bit, written
// branch-free so that the loops over it vectorise.
inline float to_bf16(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  const uint32_t r = v != v ? 0x7FC00000u : (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &r, sizeof f);
  return f;
}

// Where the torch path stores a tensor of the model's dtype: a bf16 rounding, or nothing in fp32.
template <bool BF16>
inline float rnd(float v) {
  if constexpr (BF16) {
    return to_bf16(v);
  } else {
    return v;
  }
}

// p[i] = v in T (bf16: rounded as c10 does, branch-free, so loops over it vectorise).
template <typename T>
inline void put(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>) {
    p[i] = v;
  } else {
    const float r = to_bf16(v);
    uint32_t b;
    std::memcpy(&b, &r, sizeof b);
    reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(b >> 16);
  }
}

// dst[0, n) = src in T.
template <typename T>
inline void store(T* dst, const float* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) put(dst, i, src[i]);
}

// g * sigmoid(g) with exp taken of -|g| only (vec.h's branch-free exp, within 1 ulp), so the
// loop vectorises; F.silu's g / (1 + exp(-g)) up to that rounding. The numerator is selected before
// the one division: a vectorised select of two quotients paid for both, and divisions bound the loop.
inline float silu(float g) {
  const float e = tessera_vec::exp_nonpositive(-std::fabs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

// RMSNorm of one row as model/layers.py: x fp32 (holding values of the model's dtype), w fp32 (the
// widened weight); variance in fp32, h rounded to the dtype, then w * h rounded.
template <bool BF16, typename O>
inline void rms_norm_row(const float* x, const float* w, O* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) put(out, i, rnd<BF16>(w[i] * rnd<BF16>(x[i] * inv)));
}

// a[0, n) = SiLU(g) * u as torch's F.silu(gate) * up in T: the SiLU and the product each rounded (and
// fp32 inputs first, as a bf16 path stores them; bf16 ones are exact already).
template <bool BF16, typename I, typename T>
inline void silu_mul_row(const I* g, const I* u, T* a, int64_t n) {
  constexpr bool WIDE = BF16 && std::is_same_v<I, float>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    put(a, i, rnd<BF16>(rnd<BF16>(silu(rnd<WIDE>(widen(g[i])))) * rnd<WIDE>(widen(u[i]))));
}

// f(r0, r1) over [0, rows) on the threads, in chunks of about 16k elements of `width`.
template <typename F>
inline void over_rows(int64_t rows, int64_t width, F&& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), f);
}

template <typename T>
void silu_mul_typed(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  const int64_t n = out.size(1), gs = gate.stride(0), us = up.stride(0);
  const T* g = gate.data_ptr<T>();
  const T* u = up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  over_rows(out.size(0), 2 * n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      silu_mul_row<std::is_same_v<T, c10::BFloat16>>(g + r * gs, u + r * us, o + r * n, n);
  });
}

// sum (may be undefined): where x + y is written, rounded to T; out = RMSNorm(x + y) (y undefined: of x).
template <typename T>
void rms_norm_typed(at::Tensor& out, const at::Tensor& x, const c10::optional<at::Tensor>& y,
                    const c10::optional<at::Tensor>& sum, const at::Tensor& weight, float eps) {
  constexpr bool BF16 = std::is_same_v<T, c10::BFloat16>;
  const int64_t n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* yp = y.has_value() ? y->data_ptr<T>() : nullptr;
  T* sp = sum.has_value() ? sum->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const at::Tensor wf = weight.to(at::kFloat).contiguous();
  const float* w = wf.data_ptr<float>();
  over_rows(x.size(0), n, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(n);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * n;
      if (yp) {
        const T* yr = yp + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) row[i] = rnd<BF16>(widen(xr[i]) + widen(yr[i]));
        if (sp) store(sp + r * n, row.data(), n);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) row[i] = widen(xr[i]);
      }
      rms_norm_row<BF16>(row.data(), w, op + r * n, n, eps);
    }
  });
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous() && t.sizes() == like.sizes() &&
                  t.scalar_type() == like.scalar_type(),
              "glue: ", name, " must be a contiguous CPU tensor of x's shape and dtype");
}

void check_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "glue: float32 or bfloat16 only, got ",
              t.scalar_type());
}

// out [N, I] = SiLU(gate) * up; gate and up [N, I] with unit column stride (e.g. halves of gate|up).
void silu_mul(at::Tensor out, const at::Tensor& gate, const at::Tensor& up) {
  check_dtype(gate);
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu() && gate.dim() == 2 && up.sizes() == gate.sizes() &&
                  up.scalar_type() == gate.scalar_type() && gate.stride(1) == 1 && up.stride(1) == 1,
              "glue.silu_mul: gate and up must be CPU [N, I] tensors of one dtype with unit column stride");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.sizes() == gate.sizes() &&
                  out.scalar_type() == gate.scalar_type(),
              "glue.silu_mul: out must be a contiguous [N, I] tensor of gate's dtype");
  if (gate.scalar_type() == at::kBFloat16) {
    silu_mul_typed<c10::BFloat16>(out, gate, up);
  } else {
    silu_mul_typed<float>(out, gate, up);
  }
}

// out [N, H] = RMSNorm(x (+ y)) with weight [H]; sum, if given, gets x + y.
void rms_norm(at::Tensor out, const at::Tensor& x, c10::optional<at::Tensor> y, c10::optional<at::Tensor> sum,
              const at::Tensor& weight, double eps) {
  check_dtype(x);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "glue.rms_norm: x must be a contiguous CPU [N, H]");
  check_rows(out, x, "out");
  if (y.has_value()) check_rows(*y, x, "y");
  if (sum.has_value()) {
    TORCH_CHECK(y.has_value(), "glue.rms_norm: sum needs y");
    check_rows(*sum, x, "sum");
  }
  TORCH_CHECK(weight.numel() == x.size(1), "glue.rms_norm: weight must have ", x.size(1), " elements");
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_typed<c10::BFloat16>(out, x, y, sum, weight, static_cast<float>(eps));
  } else {
    rms_norm_typed<float>(out, x, y, sum, weight, static_cast<float>(eps));
  }
}

}  // namespace tessera_glue
