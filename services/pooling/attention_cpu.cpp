// Self-attention of an encoder over packed sequences (no padding, no mask): the CPU kernel.
// The launcher, its semantics and the torch reference are in attention_cpu.py.
//
// At sentence lengths (~30 tokens) an attention head is ~100 kFLOP, and torch's per-call costs
// (SDPA over small padded groups, the gathers around it) made attention a sixth of MiniLM's
// forward for about 1 % of its FLOPs. Here one task is one sequence: per head its keys
// are widened to fp32 and transposed once ([D, L], so a query's L scores are one vectorised pass per
// dimension), its values widened ([L, D]); then per query: scores, max, exp and sum (vec.h's
// branch-free exp, which vectorises), and the probability-weighted sum of values. All sums are
// fp32; the output is rounded once to the activations' dtype. Tasks are independent, so the result
// does not depend on the thread count or on the other sequences in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "../common/kernels/vec.h"

namespace tessera_encoder {

using tessera_vec::exp_sum;
using tessera_vec::LANES;
using tessera_vec::load16;
using tessera_vec::v16;
using tessera_vec::widen;

constexpr int QB = 4;  // queries per pass: four independent FMA chains share each key load

inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// acc[r][:] = sum_j p[r][j] v[j][:] for QB queries, the head's DB * LANES dims in registers (DB <= 4:
// head_dim up to 64, BERT's sizes).
template <int DB>
inline void weigh_values(const float* p, int64_t LP, const float* v, int64_t L, float* acc) {
  v16 a[QB][DB] = {};
  for (int64_t j = 0; j < L; ++j) {
    v16 vj[DB];
    for (int b = 0; b < DB; ++b) vj[b] = load16(v + j * DB * LANES + b * LANES);
    for (int r = 0; r < QB; ++r)
      for (int b = 0; b < DB; ++b) a[r][b] += p[r * LP + j] * vj[b];
  }
  for (int r = 0; r < QB; ++r)
    for (int b = 0; b < DB; ++b) store16(acc + (r * DB + b) * LANES, a[r][b]);
}

// The same through memory, for wider heads.
inline void weigh_values_any(const float* p, int64_t LP, const float* v, int64_t L, int64_t DP, float* acc) {
  std::fill(acc, acc + QB * DP, 0.f);
  for (int r = 0; r < QB; ++r)
    for (int64_t j = 0; j < L; ++j) {
      const float pj = p[r * LP + j];
#pragma omp simd
      for (int64_t d = 0; d < DP; ++d) acc[r * DP + d] += pj * v[j * DP + d];
    }
}

template <typename T>
void run(T* out, const T* qkv, const int64_t* offsets, int64_t B, int64_t H, int64_t D, float scale) {
  const int64_t width = H * D, stride = 3 * width;  // a token's q | k | v, each [H, D]
  const int64_t DB = (D + LANES - 1) / LANES, DP = DB * LANES;
  // One task is one sequence, all heads, so its rows stay in cache from one head to the next. A
  // task's cost grows as L^2, so threads take tasks from a shared counter, longest first: a static
  // split of length-sorted batches left one thread with all the long ones.
  std::vector<int64_t> order(B);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return offsets[x + 1] - offsets[x] > offsets[y + 1] - offsets[y];
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // One head at a time: kt [D, LP], its keys transposed, LP = L rounded up to LANES (zeros past L),
    // so a query's scores against LANES keys are one vector accumulated over the D dims; v [L, DP]
    // (dims zero-padded to DP); qs [L, D] scaled. s [QB, LP]: scores, then probabilities; acc [QB, DP].
    std::vector<float> kt, v, qs, s, acc(QB * DP);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < B;) {
      const int64_t first = offsets[order[t]], L = offsets[order[t] + 1] - first;
      if (L <= 0) continue;
      const int64_t LP = (L + LANES - 1) / LANES * LANES;
      kt.assign(D * LP, 0.f);
      v.resize(L * DP);
      qs.resize(L * D);
      s.resize(QB * LP);
      for (int64_t h = 0; h < H; ++h) {
        // This head's slices of the rows, into buffers that stay in L1.
        for (int64_t j = 0; j < L; ++j) {
          const T* row = qkv + (first + j) * stride + h * D;
          float* qj = qs.data() + j * D;
          float* vj = v.data() + j * DP;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) qj[d] = widen(row[d]) * scale;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) vj[d] = widen(row[2 * width + d]);
          for (int64_t d = D; d < DP; ++d) vj[d] = 0.f;
          for (int64_t d = 0; d < D; ++d) kt[d * LP + j] = widen(row[width + d]);
        }
        const float* kh = kt.data();
        const float* vh = v.data();
        for (int64_t i0 = 0; i0 < L; i0 += QB) {
          const int64_t rows = std::min<int64_t>(QB, L - i0);
          const float* q[QB];  // past the last row, the last row again (its results are dropped)
          for (int r = 0; r < QB; ++r) q[r] = qs.data() + (i0 + std::min<int64_t>(r, rows - 1)) * D;
          for (int64_t j0 = 0; j0 < LP; j0 += LANES) {
            v16 a[QB] = {};
            for (int64_t d = 0; d < D; ++d) {
              const v16 k = load16(kh + d * LP + j0);
              for (int r = 0; r < QB; ++r) a[r] += q[r][d] * k;
            }
            for (int r = 0; r < QB; ++r) store16(s.data() + r * LP + j0, a[r]);
          }
          float inv[QB];
          for (int r = 0; r < QB; ++r) {
            float* sp = s.data() + r * LP;
            float m = sp[0];
#pragma omp simd reduction(max : m)
            for (int64_t j = 1; j < L; ++j) m = std::max(m, sp[j]);
            // The padding keys past L (zero scores) get probability 0.
            for (int64_t j = L; j < LP; ++j) sp[j] = -std::numeric_limits<float>::infinity();
            inv[r] = 1.0f / exp_sum(sp, LP, m);
          }
          switch (DB) {
            case 1: weigh_values<1>(s.data(), LP, vh, L, acc.data()); break;
            case 2: weigh_values<2>(s.data(), LP, vh, L, acc.data()); break;
            case 3: weigh_values<3>(s.data(), LP, vh, L, acc.data()); break;
            case 4: weigh_values<4>(s.data(), LP, vh, L, acc.data()); break;
            default: weigh_values_any(s.data(), LP, vh, L, DP, acc.data());
          }
          for (int64_t r = 0; r < rows; ++r) {
            T* oi = out + (first + i0 + r) * width + h * D;
            for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<T>(acc[r * DP + d] * inv[r]);
          }
        }
      }
    }
  });
}

// out [T, H * D] = softmax(q k^T * scale) v within each sequence; qkv [T, 3 * H * D] (q | k | v, each
// head-major), offsets [B + 1] int64 (sequence b is tokens offsets[b] .. offsets[b + 1] - 1).
void attention(at::Tensor out, const at::Tensor& qkv, const at::Tensor& offsets, int64_t heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && out.dim() == 2 && qkv.is_contiguous() && out.is_contiguous() && qkv.device().is_cpu(),
              "encoder attention: qkv and out must be contiguous 2-D CPU tensors");
  TORCH_CHECK(heads > 0 && qkv.size(1) % (3 * heads) == 0, "encoder attention: qkv's width must be 3 * heads * D");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (3 * heads);
  TORCH_CHECK(out.size(0) == T && out.size(1) == heads * D && out.scalar_type() == qkv.scalar_type(),
              "encoder attention: out must be [", T, ", ", heads * D, "] in qkv's dtype");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() && offsets.numel() >= 1,
              "encoder attention: offsets must be a contiguous int64 [B + 1]");
  const int64_t B = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[B] == T, "encoder attention: offsets must run from 0 to ", T);
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(off[b + 1] >= off[b], "encoder attention: offsets must not decrease");
  const float sc = static_cast<float>(scale);
  if (qkv.scalar_type() == at::kBFloat16) {
    run(out.data_ptr<c10::BFloat16>(), qkv.data_ptr<c10::BFloat16>(), off, B, heads, D, sc);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kFloat, "encoder attention: float32 or bfloat16, got ", qkv.scalar_type());
    run(out.data_ptr<float>(), qkv.data_ptr<float>(), off, B, heads, D, sc);
  }
}

}  // namespace tessera_encoder

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &tessera_encoder::attention, "self-attention within each packed sequence", pybind11::arg("out"),
        pybind11::arg("qkv"), pybind11::arg("offsets"), pybind11::arg("heads"), pybind11::arg("scale"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
