// Every decoder layer of a decode step in one call: the CPU kernel.
// The launcher, its semantics and the torch reference are in decode_stack_cpu.py.
//
// Besides its four matmuls and the paged attention (paged_attention.h), a layer is ~40 small
// torch ops (two RMSNorms, the rotary, the cache write, SiLU, the residual adds, views and splits),
// whose dispatch costs about as much as the matmuls at batch 1 on a 2-core machine. Here
// the same layer runs as one loop: each matmul on its Linear's load-time path (gemv.h up to a
// few rows, else oneDNN's packed or the plain library matmul, or tile_gemm.h's panels from
// more than a few rows where the runner chose them at load; int8 and grouped weights on widen_gemm.h above a
// few rows where their Linears run it, stack_projection.h), the attention operator, and a few
// vectorised elementwise passes per row, with no Python and no dispatcher in between.
//
// Activations live in fp32 buffers. In bfloat16 mode each value is rounded to bf16 wherever the
// torch path stores a bf16 tensor (after each matmul, norm, rotary product, add and SiLU), so the
// results track that path; the matmul and attention sums are fp32 in both, as there.
//
// LoRA adapters (lora_rows.h, lora_step.h): per layer and target one arena (set_lora), per step each row's span in it.
// A projection with adapter rows in the step has its output widened into an fp32 buffer, rounded as stored,
// the corrections added there (bf16: rnd(rnd(base) + rnd(delta))), and the layer goes on from that buffer;
// rounding is idempotent, so a row without adapters comes out bit for bit as in a step without them.
#include "glue.h"
#include "lora_step.h"
#include "paged_attention.h"
#include "stack_projection.h"

#include <ATen/ATen.h>

#include <cmath>

namespace tessera_stack {

struct Layer {
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // fp32 copies; q/k_norm undefined without them
  Proj qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [NB, BS, KVH, D], the model's dtype
  tessera_lora::Arenas lora;
};

using tessera_glue::rnd;
using tessera_glue::store;

class DecodeStack {
 public:
  // The activations' dtype is the norms' (the model's): float32 or bfloat16.
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
              at::Tensor final_norm)
      : H_(heads), KVH_(kv_heads), D_(head_dim), hidden_(hidden), inter_(intermediate), eps_(static_cast<float>(eps)),
        dtype_(final_norm.scalar_type()),
        final_norm_(norm_weight(final_norm, hidden, "final norm")) {
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "decode_stack: float32 or bfloat16 activations");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0 && head_dim <= 512,
                "decode_stack: heads must be a multiple of kv_heads, head_dim even and at most 512");
  }

  void add_layer(at::Tensor in_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, const Proj& qkv, const Proj& o, const Proj& gate_up,
                 const Proj& down, at::Tensor k_cache, at::Tensor v_cache) {
    Layer L;
    L.in_norm = norm_weight(in_norm, hidden_, "input norm");
    L.post_norm = norm_weight(post_norm, hidden_, "post-attention norm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_stack: q_norm and k_norm come together");
    if (q_norm.has_value()) {
      L.q_norm = norm_weight(*q_norm, D_, "q_norm");
      L.k_norm = norm_weight(*k_norm, D_, "k_norm");
    }
    L.qkv = qkv;
    L.o = o;
    L.gate_up = gate_up;
    L.down = down;
    TORCH_CHECK(L.qkv.K == hidden_ && L.qkv.N == (H_ + 2 * KVH_) * D_, "decode_stack: qkv must be [",
                (H_ + 2 * KVH_) * D_, ", ", hidden_, "]");
    TORCH_CHECK(L.o.K == H_ * D_ && L.o.N == hidden_, "decode_stack: o_proj must be [", hidden_, ", ", H_ * D_, "]");
    TORCH_CHECK(L.gate_up.K == hidden_ && L.gate_up.N == 2 * inter_, "decode_stack: gate_up must be [", 2 * inter_,
                ", ", hidden_, "]");
    TORCH_CHECK(L.down.K == inter_ && L.down.N == hidden_, "decode_stack: down_proj must be [", hidden_, ", ",
                inter_, "]");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == KVH_ &&
                    k_cache.size(3) == D_ && k_cache.scalar_type() == dtype_ && v_cache.scalar_type() == dtype_ &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(),
                "decode_stack: k/v cache must be contiguous [NB, BS, ", KVH_, ", ", D_, "] in the model's dtype");
    L.k_cache = k_cache;
    L.v_cache = v_cache;
    layers_.push_back(std::move(L));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The LoRA rows' least work per task (lora_rows.h COARSE or FINE) and how their blocks ask for their rows
  // ahead, as the execution plan chose. Between steps.
  void set_lora_reading(int64_t grain, int64_t prefetch) {
    TORCH_CHECK(grain > 0, "decode_stack.set_lora_reading: grain must be positive, got ", grain);
    lora_ahead_ = tessera_lora::ahead_of(prefetch, "decode_stack.set_lora_reading");
    lora_grain_ = grain;
  }

  // The row count above which every projection with panels runs them (the execution plan's measurement at load:
  // runner/fused_decode.py). Between steps.
  void set_tiles_above(int64_t rows) {
    TORCH_CHECK(rows >= 1, "decode_stack.set_tiles_above: rows must be >= 1, got ", rows);
    for (Layer& L : layers_)
      for (Proj* p : {&L.qkv, &L.o, &L.gate_up, &L.down}) p->tiles_above = rows;
  }

  // Target t's arena of `layer` (t in lora.weights.TARGETS order): A [P, K], Bt [P, N] contiguous in the model's
  // dtype, K and N its projection's (columns()); None clears it. Between steps only (the step reads them).
  void set_lora(int64_t layer, int64_t target, c10::optional<at::Tensor> A, c10::optional<at::Tensor> Bt) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "decode_stack.set_lora: layer ", layer, " of ", num_layers());
    TORCH_CHECK(target >= 0 && target < tessera_lora::TARGETS, "decode_stack.set_lora: target ", target, " of ",
                tessera_lora::TARGETS);
    TORCH_CHECK(A.has_value() == Bt.has_value(), "decode_stack.set_lora: A and Bt come together");
    tessera_lora::Arenas& arenas = layers_[layer].lora;
    if (!A.has_value()) {
      arenas.a[target] = arenas.bt[target] = at::Tensor();
      return;
    }
    const tessera_lora::Columns c = columns(static_cast<int>(target));
    TORCH_CHECK(A->dim() == 2 && Bt->dim() == 2 && A->size(0) == Bt->size(0) && A->size(1) == c.k &&
                    Bt->size(1) == c.n && A->is_contiguous() && Bt->is_contiguous() && A->device().is_cpu() &&
                    Bt->device().is_cpu() && A->scalar_type() == dtype_ && Bt->scalar_type() == dtype_,
                "decode_stack.set_lora: target ", target, " needs contiguous CPU A [P, ", c.k, "] and Bt [P, ", c.n,
                "] in the model's dtype, got ", A->sizes(), " and ", Bt->sizes());
    arenas.a[target] = *A;
    arenas.bt[target] = *Bt;
  }

  // x [M, hidden] (model dtype) in place -> final-normed hidden states. cos/sin [M, D] (sin's first
  // half negated, rotary.cos_sin's form), slots [M] int64, block_tables [M, nb] int32, context_lens
  // [M] int32 (each row's position + 1: its own new key is the last one it reads). lora_offsets/lora_ranks
  // [TARGETS, M] int32 or None: each row's span per target in that target's arenas (rank 0: no adapter).
  void forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
               const at::Tensor& block_tables, const at::Tensor& context_lens,
               const c10::optional<at::Tensor>& lora_offsets, const c10::optional<at::Tensor>& lora_ranks) {
    const int64_t M = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == dtype_ && x.is_contiguous(),
                "decode_stack: x must be contiguous [M, ", hidden_, "] in the model's dtype");
    TORCH_CHECK(M >= 1, "decode_stack: no rows");
    TORCH_CHECK(cos.scalar_type() == dtype_ && sin.scalar_type() == dtype_ && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == M * D_ && sin.numel() == M * D_,
                "decode_stack: cos/sin must be contiguous [M, ", D_, "] in the model's dtype");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == M,
                "decode_stack: slots must be a contiguous int64 [M]");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == M && context_lens.numel() == M,
                "decode_stack: one block table and context length per row");
    TORCH_CHECK(!layers_.empty(), "decode_stack: no layers");
    const int64_t slot_count = layers_[0].k_cache.size(0) * layers_[0].k_cache.size(1);
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(sp[m] >= 0 && sp[m] < slot_count, "decode_stack: slot ", sp[m], " out of range");
    const tessera_lora::Step step = lora_step(lora_offsets, lora_ranks, M);
    if (dtype_ == at::kBFloat16) {
      run<c10::BFloat16>(x, cos, sin, sp, block_tables, context_lens, step);
    } else {
      run<float>(x, cos, sin, sp, block_tables, context_lens, step);
    }
  }

 private:
  int64_t H_, KVH_, D_, hidden_, inter_;
  float eps_;
  at::ScalarType dtype_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  int64_t lora_grain_ = tessera_lora::COARSE;
  tessera_lora::Ahead lora_ahead_ = tessera_lora::Ahead::paced;

  tessera_lora::Columns columns(int t) const { return tessera_lora::columns(t, H_, KVH_, D_, hidden_, inter_); }

  tessera_lora::Step lora_step(const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& ranks,
                               int64_t M) const {
    return tessera_lora::make_step(offsets, ranks, M, static_cast<int64_t>(layers_.size()),
                                   [&](int64_t l) -> const tessera_lora::Arenas& { return layers_[l].lora; });
  }

  static at::Tensor norm_weight(const at::Tensor& w, int64_t n, const char* name) {
    TORCH_CHECK(w.numel() == n, "decode_stack: ", name, " weight must have ", n, " elements");
    return w.to(at::kFloat).contiguous();
  }

  template <bool BF16, typename O>
  void rms_norm(const float* x, const float* w, O* out, int64_t n) const {
    tessera_glue::rms_norm_row<BF16>(x, w, out, n, eps_);
  }

  // x * cos + roll(x, D/2) * sin over one head, each product and the sum rounded as torch would.
  template <bool BF16>
  void rotate(float* x, const float* c, const float* s) const {
    const int64_t half = D_ / 2;
    float tmp[512];
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) tmp[i] = rnd<BF16>(rnd<BF16>(x[i] * c[i]) + rnd<BF16>(x[i + half] * s[i]));
#pragma omp simd
    for (int64_t i = half; i < D_; ++i) tmp[i] = rnd<BF16>(rnd<BF16>(x[i] * c[i]) + rnd<BF16>(x[i - half] * s[i]));
    std::memcpy(x, tmp, D_ * sizeof(float));
  }

  // f(m) for every row: on the threads when there are more rows than the few-row kernel takes (each
  // row's work is the same whoever runs it, so results do not depend on the split).
  template <typename F>
  static void each_row(int64_t M, F&& f) {
    if (M <= tessera_gemv::MAX_ROWS) {
      for (int64_t m = 0; m < M; ++m) f(m);
    } else {
      at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) f(m);
      });
    }
  }

  template <typename T>
  void run(at::Tensor& x_t, const at::Tensor& cos_t, const at::Tensor& sin_t, const int64_t* slots,
           const at::Tensor& tables, const at::Tensor& lens, const tessera_lora::Step& step) {
    const int64_t M = x_t.size(0), hid = hidden_, qkv_n = (H_ + 2 * KVH_) * D_, q_n = H_ * D_, kv_n = KVH_ * D_;
    const int64_t inter = inter_;
    constexpr bool BF16 = std::is_same_v<T, c10::BFloat16>;
    // x: the residual stream in fp32 (bf16 values in bf16 mode); h, act: matmul inputs in T.
    std::vector<float> x(M * hid), qkv(M * qkv_n), y(M * std::max(hid, 2 * inter)), cs(M * D_), sn(M * D_);
    std::vector<T> h(M * hid), act(M * inter);
    T* xp = x_t.data_ptr<T>();
    const T* cp = cos_t.data_ptr<T>();
    const T* snp = sin_t.data_ptr<T>();
    for (int64_t i = 0; i < M * hid; ++i) x[i] = tessera_vec::widen(xp[i]);
    for (int64_t i = 0; i < M * D_; ++i) {
      cs[i] = tessera_vec::widen(cp[i]);
      sn[i] = tessera_vec::widen(snp[i]);
    }
    // q and the attention output in the cache dtype, as paged_decode takes them; reused by every layer.
    at::Tensor q_t = at::empty({M, H_, D_}, x_t.options());
    at::Tensor o_t = at::empty({M, H_, D_}, x_t.options());
    T* qp = q_t.data_ptr<T>();
    const T* op = o_t.data_ptr<T>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
    at::Tensor hold;  // a library matmul's output, read before the next projection runs
    auto residual = [&](const std::pair<const float*, const T*>& out) {  // x += out, rounded as torch's add
      with_output(out, [&](const auto* src) {
        each_row(M, [&](int64_t m) {
#pragma omp simd
          for (int64_t i = m * hid; i < (m + 1) * hid; ++i)
            x[i] = rnd<BF16>(x[i] + rnd<BF16>(tessera_vec::widen(src[i])));
        });
      });
    };
    // out, a projection's output [M, width], with the corrections of targets [t0, t1) (input `in`) added: in buf
    // (fp32, rounded as stored) when the step has rows on them, else out as it was.
    using Out = std::pair<const float*, const T*>;
    auto lora = [&](const Layer& L, const Out& out, float* buf, int64_t width, const T* in, int t0, int t1) -> Out {
      if (!step.any(t0, t1)) return out;
      with_output(out, [&](const auto* src) {
        each_row(M, [&](int64_t m) {
#pragma omp simd
          for (int64_t i = m * width; i < (m + 1) * width; ++i) buf[i] = rnd<BF16>(tessera_vec::widen(src[i]));
        });
      });
      tessera_lora::Job<T, T, float> jobs[tessera_lora::TARGETS];
      int count = 0;
      for (int t = t0; t < t1; ++t) {
        if (!step.active[t]) continue;
        const tessera_lora::Columns c = columns(t);
        jobs[count++] = {in, c.k, buf + c.col, width, L.lora.a[t].data_ptr<T>(), L.lora.bt[t].data_ptr<T>(),
                         c.k, c.n, step.offsets + t * M, step.ranks + t * M, M};
      }
      tessera_lora::rows<BF16>(jobs, count, lora_grain_, lora_ahead_);  // the targets' blocks in one region
      return {buf, nullptr};
    };
    for (const Layer& L : layers_) {
      each_row(M, [&](int64_t m) { rms_norm<BF16>(&x[m * hid], L.in_norm.data_ptr<float>(), &h[m * hid], hid); });
      const auto qkv_out = lora(L, L.qkv(h.data(), qkv.data(), M, hold), qkv.data(), qkv_n, h.data(), 0, 3);
      T* kc = L.k_cache.data_ptr<T>();
      T* vc = L.v_cache.data_ptr<T>();
      with_output(qkv_out, [&](const auto* src) {
        each_row(M, [&](int64_t m) {
          float* row = &qkv[m * qkv_n];
#pragma omp simd
          for (int64_t i = 0; i < qkv_n; ++i) row[i] = rnd<BF16>(tessera_vec::widen(src[m * qkv_n + i]));
          for (int64_t head = 0; head < H_ + KVH_; ++head) {  // q heads, then k heads
            float* v = row + head * D_;
            if (L.q_norm.defined()) {  // Qwen3: RMSNorm per head before the rotary
              float tmp[512];
              rms_norm<BF16>(v, (head < H_ ? L.q_norm : L.k_norm).data_ptr<float>(), tmp, D_);
              std::memcpy(v, tmp, D_ * sizeof(float));
            }
            rotate<BF16>(v, &cs[m * D_], &sn[m * D_]);
          }
          store(qp + m * q_n, row, q_n);
          store(kc + slots[m] * kv_n, row + q_n, kv_n);
          store(vc + slots[m] * kv_n, row + q_n + kv_n, kv_n);
        });
      });
      tessera_paged::paged_decode(o_t, q_t, L.k_cache, L.v_cache, tables, lens, c10::nullopt, scale);
      residual(lora(L, L.o(op, y.data(), M, hold), y.data(), hid, op, 3, 4));
      each_row(M, [&](int64_t m) { rms_norm<BF16>(&x[m * hid], L.post_norm.data_ptr<float>(), &h[m * hid], hid); });
      with_output(lora(L, L.gate_up(h.data(), y.data(), M, hold), y.data(), 2 * inter, h.data(), 4, 6),
                  [&](const auto* src) {
        each_row(M, [&](int64_t m) {
          const auto* g = src + m * 2 * inter;
          const auto* u = g + inter;
          tessera_glue::silu_mul_row<BF16>(g, u, &act[m * inter], inter);
        });
      });
      residual(lora(L, L.down(act.data(), y.data(), M, hold), y.data(), hid, act.data(), 6, 7));
    }
    each_row(M, [&](int64_t m) { rms_norm<BF16>(&x[m * hid], final_norm_.data_ptr<float>(), xp + m * hid, hid); });
  }
};

}  // namespace tessera_stack

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using tessera_stack::DecodeStack;
  using tessera_stack::Proj;
  pybind11::class_<Proj>(m, "Projection")
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          std::vector<int64_t>, std::vector<bool>, int64_t, c10::optional<at::Tensor>, int64_t,
                          c10::optional<at::Tensor>, int64_t, int64_t, int64_t, bool, int64_t, int64_t, int64_t>(),
           pybind11::arg("weight"), pybind11::arg("scale"), pybind11::arg("bias"), pybind11::arg("packed"),
           pybind11::arg("starts"), pybind11::arg("flags"), pybind11::arg("gemv_rows"), pybind11::arg("tiles"),
           pybind11::arg("bf16_row"), pybind11::arg("offset") = pybind11::none(), pybind11::arg("bits") = 0,
           pybind11::arg("group") = 0, pybind11::arg("widen") = 0, pybind11::arg("tiles_amx") = false,
           pybind11::arg("grouped_loop"), pybind11::arg("ahead") = 0, pybind11::arg("streams") = 1);
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor>(),
           pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("hidden"),
           pybind11::arg("intermediate"), pybind11::arg("eps"), pybind11::arg("final_norm"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_lora", &DecodeStack::set_lora, "a layer's arena for one LoRA target (None, None: none)",
           pybind11::arg("layer"), pybind11::arg("target"), pybind11::arg("A"), pybind11::arg("Bt"))
      .def("set_tiles_above", &DecodeStack::set_tiles_above, "the rows above which projections run their panels")
      .def("set_lora_reading", &DecodeStack::set_lora_reading,
           "the LoRA rows' least work per task and how they are asked for ahead (lora_rows.h Ahead)",
           pybind11::arg("grain"), pybind11::arg("prefetch"))
      .def("forward", &DecodeStack::forward, "every layer of a few-row decode step, x in place",
           pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("slots"),
           pybind11::arg("block_tables"), pybind11::arg("context_lens"), pybind11::arg("lora_offsets") = pybind11::none(),
           pybind11::arg("lora_ranks") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
}
