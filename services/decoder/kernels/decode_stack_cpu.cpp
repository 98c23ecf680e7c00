// Every decoder layer of a few-row decode step in one call: the CPU kernel.
// The launcher, its semantics and the torch reference are in decode_stack_cpu.py.
//
// At batch 1 a step streams every weight once (gemv_cpu.cpp) and attends over a short context
// (paged_attention_cpu.cpp); everything else per layer is ~40 tiny torch ops (two RMSNorms, the
// rotary, the cache write, SiLU, the residual adds, views and splits), whose dispatch costs about
// as much as the matmuls on a 2-core machine (issue 10). Here the same layer runs as one loop over
// those two kernels and a few elementwise passes over M <= 4 rows, with no Python and no
// dispatcher between them.
//
// Activations live in fp32 buffers. In bfloat16 mode each value is rounded to bf16 wherever the
// torch path stores a bf16 tensor (after each matmul, norm, rotary product, add and SiLU), so the
// results track that path; the matmul and attention sums are fp32 in both, as there.
#define TESSERA_NO_MODULE
#include "gemv_cpu.cpp"
#include "paged_attention_cpu.cpp"

#include <cmath>
#include <memory>

namespace tessera_stack {

using tessera_gemv::dispatch_rows;

// One projection: weight [N, K] float32, bfloat16 or int8 (with fp32 per-row scale), fp32 bias.
struct Proj {
  at::Tensor w, scale, bias;  // scale and bias undefined when absent
  int64_t N = 0, K = 0;

  Proj() = default;
  Proj(at::Tensor w_, c10::optional<at::Tensor> s, c10::optional<at::Tensor> b, const char* name) : w(std::move(w_)) {
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "decode_stack: ", name,
                " weight must be a contiguous 2-D CPU tensor");
    N = w.size(0);
    K = w.size(1);
    const auto t = w.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kChar, "decode_stack: ", name,
                " weight must be float32, bfloat16 or int8, got ", t);
    TORCH_CHECK(s.has_value() == (t == at::kChar), "decode_stack: ", name, ": int8 weights and only they need a scale");
    if (s.has_value()) scale = s->to(at::kFloat).contiguous();
    if (b.has_value()) bias = b->to(at::kFloat).contiguous();
    TORCH_CHECK(!scale.defined() || scale.numel() == N, "decode_stack: ", name, " scale must be [", N, "]");
    TORCH_CHECK(!bias.defined() || bias.numel() == N, "decode_stack: ", name, " bias must be [", N, "]");
  }

  // y [M, N] = x [M, K] @ w^T (* scale) (+ bias), fp32 in and out. x_is_bf16: every x is a bf16 value
  // (the stack's bf16 mode), so bf16 weights may take gemv's bf16 dot product (exact products too).
  void operator()(const float* x, float* y, int64_t M, bool x_is_bf16) const {
    const float* sp = scale.defined() ? scale.data_ptr<float>() : nullptr;
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    switch (w.scalar_type()) {
      case at::kFloat: return dispatch_rows(M, x, w.data_ptr<float>(), sp, bp, y, N, K);
      case at::kBFloat16:
        if (x_is_bf16) {
          std::vector<at::BFloat16> xb(x, x + M * K);  // exact: the values are bf16 already
          return tessera_gemv::dispatch_bf16(M, xb.data(), w.data_ptr<at::BFloat16>(), bp, y, N, K);
        }
        return dispatch_rows(M, x, w.data_ptr<at::BFloat16>(), sp, bp, y, N, K);
      default: return dispatch_rows(M, x, w.data_ptr<int8_t>(), sp, bp, y, N, K);
    }
  }
};

struct Layer {
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // fp32 copies; q/k_norm undefined without them
  Proj qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [NB, BS, KVH, D], the model's dtype
};

inline float to_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }  // round to nearest even

class DecodeStack {
 public:
  // The activations' dtype is the norms' (the model's): float32 or bfloat16.
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
              at::Tensor final_norm)
      : H_(heads), KVH_(kv_heads), D_(head_dim), hidden_(hidden), inter_(intermediate), eps_(static_cast<float>(eps)),
        bf16_(final_norm.scalar_type() == at::kBFloat16), dtype_(final_norm.scalar_type()),
        final_norm_(norm_weight(final_norm, hidden, "final norm")) {
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "decode_stack: float32 or bfloat16 activations");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
                "decode_stack: heads must be a multiple of kv_heads and head_dim even");
  }

  void add_layer(at::Tensor in_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, at::Tensor qkv_w, c10::optional<at::Tensor> qkv_s,
                 c10::optional<at::Tensor> qkv_b, at::Tensor o_w, c10::optional<at::Tensor> o_s,
                 c10::optional<at::Tensor> o_b, at::Tensor gu_w, c10::optional<at::Tensor> gu_s,
                 c10::optional<at::Tensor> gu_b, at::Tensor down_w, c10::optional<at::Tensor> down_s,
                 c10::optional<at::Tensor> down_b, at::Tensor k_cache, at::Tensor v_cache) {
    Layer L;
    L.in_norm = norm_weight(in_norm, hidden_, "input norm");
    L.post_norm = norm_weight(post_norm, hidden_, "post-attention norm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_stack: q_norm and k_norm come together");
    if (q_norm.has_value()) {
      L.q_norm = norm_weight(*q_norm, D_, "q_norm");
      L.k_norm = norm_weight(*k_norm, D_, "k_norm");
    }
    L.qkv = Proj(qkv_w, qkv_s, qkv_b, "qkv");
    L.o = Proj(o_w, o_s, o_b, "o_proj");
    L.gate_up = Proj(gu_w, gu_s, gu_b, "gate_up");
    L.down = Proj(down_w, down_s, down_b, "down_proj");
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

  // x [M, hidden] (model dtype) in place -> final-normed hidden states. cos/sin [M, D] (sin's first
  // half negated, rotary.cos_sin's form), slots [M] int64, block_tables [M, nb] int32, context_lens
  // [M] int32 (each row's position + 1: its own new key is the last one it reads).
  void forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
               const at::Tensor& block_tables, const at::Tensor& context_lens) {
    const int64_t M = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == dtype_ && x.is_contiguous(),
                "decode_stack: x must be contiguous [M, ", hidden_, "] in the model's dtype");
    TORCH_CHECK(M >= 1 && M <= 4, "decode_stack: 1 to 4 rows, got ", M);
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
    if (bf16_) {
      run<c10::BFloat16>(x, cos, sin, sp, block_tables, context_lens);
    } else {
      run<float>(x, cos, sin, sp, block_tables, context_lens);
    }
  }

 private:
  int64_t H_, KVH_, D_, hidden_, inter_;
  float eps_;
  bool bf16_;
  at::ScalarType dtype_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;

  static at::Tensor norm_weight(const at::Tensor& w, int64_t n, const char* name) {
    TORCH_CHECK(w.numel() == n, "decode_stack: ", name, " weight must have ", n, " elements");
    return w.to(at::kFloat).contiguous();
  }

  float round(float v) const { return bf16_ ? to_bf16(v) : v; }

  // RMSNorm as model/layers.py: variance in fp32, h rounded to the dtype, then weight * h (rounded).
  void rms_norm(const float* x, const float* w, float* out, int64_t n) const {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps_);
    for (int64_t i = 0; i < n; ++i) out[i] = round(w[i] * round(x[i] * inv));
  }

  // x * cos + roll(x, D/2) * sin over one head, each product and the sum rounded as torch would.
  void rotate(float* x, const float* c, const float* s) const {
    const int64_t half = D_ / 2;
    float tmp[512];
    TORCH_CHECK(D_ <= 512, "decode_stack: head_dim over 512");
    for (int64_t i = 0; i < D_; ++i) {
      const float rolled = x[i < half ? i + half : i - half];
      tmp[i] = round(round(x[i] * c[i]) + round(rolled * s[i]));
    }
    std::memcpy(x, tmp, D_ * sizeof(float));
  }

  template <typename T>
  void run(at::Tensor& x_t, const at::Tensor& cos_t, const at::Tensor& sin_t, const int64_t* slots,
           const at::Tensor& tables, const at::Tensor& lens) {
    const int64_t M = x_t.size(0), hid = hidden_, qkv_n = (H_ + 2 * KVH_) * D_, q_n = H_ * D_, kv_n = KVH_ * D_;
    std::vector<float> x(M * hid), h(M * hid), qkv(M * qkv_n), attn(M * q_n), y(M * hid), gu(M * 2 * inter_),
        act(M * inter_), cs(M * D_), sn(M * D_);
    T* xp = x_t.data_ptr<T>();
    for (int64_t i = 0; i < M * hid; ++i) x[i] = tessera_paged::widen(xp[i]);
    for (int64_t i = 0; i < M * D_; ++i) {
      cs[i] = tessera_paged::widen(cos_t.data_ptr<T>()[i]);
      sn[i] = tessera_paged::widen(sin_t.data_ptr<T>()[i]);
    }
    // q and the attention output in the cache dtype, as paged_decode takes them; reused by every layer.
    at::Tensor q_t = at::empty({M, H_, D_}, x_t.options());
    at::Tensor o_t = at::empty({M, H_, D_}, x_t.options());
    T* qp = q_t.data_ptr<T>();
    const T* op = o_t.data_ptr<T>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
    for (const Layer& L : layers_) {
      for (int64_t m = 0; m < M; ++m) rms_norm(&x[m * hid], L.in_norm.data_ptr<float>(), &h[m * hid], hid);
      L.qkv(h.data(), qkv.data(), M, bf16_);
      T* kc = L.k_cache.data_ptr<T>();
      T* vc = L.v_cache.data_ptr<T>();
      for (int64_t m = 0; m < M; ++m) {
        float* row = &qkv[m * qkv_n];
        for (int64_t i = 0; i < qkv_n; ++i) row[i] = round(row[i]);
        for (int64_t head = 0; head < H_ + KVH_; ++head) {  // q heads, then k heads
          float* v = row + head * D_;
          if (L.q_norm.defined()) {  // Qwen3: RMSNorm per head before the rotary
            float tmp[512];
            rms_norm(v, (head < H_ ? L.q_norm : L.k_norm).data_ptr<float>(), tmp, D_);
            std::memcpy(v, tmp, D_ * sizeof(float));
          }
          rotate(v, &cs[m * D_], &sn[m * D_]);
        }
        for (int64_t i = 0; i < q_n; ++i) qp[m * q_n + i] = static_cast<T>(row[i]);
        T* kd = kc + slots[m] * kv_n;
        T* vd = vc + slots[m] * kv_n;
        for (int64_t i = 0; i < kv_n; ++i) {
          kd[i] = static_cast<T>(row[q_n + i]);
          vd[i] = static_cast<T>(row[q_n + kv_n + i]);
        }
      }
      tessera_paged::paged_decode(o_t, q_t, L.k_cache, L.v_cache, tables, lens, c10::nullopt, scale);
      for (int64_t i = 0; i < M * q_n; ++i) attn[i] = tessera_paged::widen(op[i]);
      L.o(attn.data(), y.data(), M, bf16_);
      for (int64_t i = 0; i < M * hid; ++i) x[i] = round(x[i] + round(y[i]));
      for (int64_t m = 0; m < M; ++m) rms_norm(&x[m * hid], L.post_norm.data_ptr<float>(), &h[m * hid], hid);
      L.gate_up(h.data(), gu.data(), M, bf16_);
      for (int64_t m = 0; m < M; ++m) {
        const float* g = &gu[m * 2 * inter_];
        const float* u = g + inter_;
        float* a = &act[m * inter_];
        for (int64_t i = 0; i < inter_; ++i) {
          const float gv = round(g[i]);
          a[i] = round(round(gv / (1.0f + std::exp(-gv))) * round(u[i]));
        }
      }
      L.down(act.data(), y.data(), M, bf16_);
      for (int64_t i = 0; i < M * hid; ++i) x[i] = round(x[i] + round(y[i]));
    }
    for (int64_t m = 0; m < M; ++m) {
      rms_norm(&x[m * hid], final_norm_.data_ptr<float>(), &h[m * hid], hid);
      for (int64_t i = 0; i < hid; ++i) xp[m * hid + i] = static_cast<T>(h[m * hid + i]);
    }
  }
};

}  // namespace tessera_stack

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using tessera_stack::DecodeStack;
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor>(),
           pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("hidden"),
           pybind11::arg("intermediate"), pybind11::arg("eps"), pybind11::arg("final_norm"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, "every layer of a few-row decode step, x in place",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
