// The decode stack's side of multi-LoRA (decode_stack_cpu.cpp): a layer's arenas per target, where each target's
// corrections land in a layer's outputs, and one step's spans, checked against every layer's arenas. The loops
// are lora_rows.h's.
#pragma once

#include <ATen/ATen.h>

#include "lora_rows.h"

namespace tessera_lora {

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
