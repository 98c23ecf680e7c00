// One projection of the decode stack (decode_stack_cpu.cpp): a layer's matmul on its Linear's load-time path.
// The launcher, its semantics and the torch reference are in decode_stack_cpu.py.
#pragma once

#include "gemv.h"
#include "gemv_grouped.h"
#include "glue.h"
#include "tile_gemm.h"
#include "../../common/kernels/amx_gemm.h"
#include "widen_gemm.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace tessera_stack {

using tessera_gemv::dispatch_rows;

constexpr int64_t TILES_ABOVE = 4;  // a projection's panels (tiles) run above this many rows unless the stack sets it

// oneDNN's packed linear (services/common/linear_path.py's packed path), called through the dispatcher:
// the op is registered by torch itself, and a boxed call needs no C++ signature from its headers.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias.defined() ? c10::IValue(bias) : c10::IValue(), std::string("none"),
                                 c10::List<c10::optional<at::Scalar>>(), c10::optional<std::string>("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One projection: weight [N, K] float32, bfloat16 or int8 (with fp32 per-row scale), and how the
// model's Linear runs it: the few-row kernel up to gemv_rows rows (its load-time choice, at most
// MAX_ROWS), above that its oneDNN-packed copy for the row counts its rule gives (rows in
// [starts[i], starts[i+1]) packed iff flags[i]; a bf16 weight's copy may be fp32), else plain. Or grouped
// (gemv_grouped.h): weight uint8 codes [N, K * bits / 8], scale and offset fp16 [N, K / group], the kernel
// gemv_grouped.h's. Above their gemv_rows, int8 and grouped weights whose Linear runs widen_gemm.h (widen: 1 fp32
// products, 2 bf16) or amx_gemm.h (widen 3) run it here too; others are refused there.
struct Proj {
  // undefined when absent; bias: fp32, bias_model: the model's; tiles: tessera_tiles::pack(w), or where tiles_amx
  // (a bf16 weight, on a CPU with AMX) tessera_amx::pack(w)
  at::Tensor w, scale, bias, bias_model, packed, tiles, offset;
  std::vector<int64_t> starts;
  std::vector<bool> flags;
  int64_t N = 0, K = 0, gemv_rows = 0, bits = 0, group = 0, widen = 0;
  int64_t ahead = 0;  // the few-row kernels' prefetch distance, bytes (tessera_vec::prefetch_ahead)
  int64_t streams = 1;  // their order over the weight rows (tessera_vec::each_weight_row)
  int64_t tiles_above = TILES_ABOVE;  // rows above which `tiles` run, where defined (DecodeStack::set_tiles_above)
  bool tiles_amx = false;
  tessera_gemv::Bf16Row bf16_row = tessera_gemv::Bf16Row::rowwise;  // the Linear's loop (gemv_bf16.h)
  tessera_grouped::Loop grouped_loop = tessera_grouped::Loop::chunks;  // a grouped weight's (gemv_grouped.h)

  Proj() = default;
  Proj(at::Tensor w_, c10::optional<at::Tensor> s, c10::optional<at::Tensor> b, c10::optional<at::Tensor> packed_,
       std::vector<int64_t> starts_, std::vector<bool> flags_, int64_t gemv_rows_,
       c10::optional<at::Tensor> tiles_, int64_t bf16_row_, c10::optional<at::Tensor> offset_, int64_t bits_,
       int64_t group_, int64_t widen_, bool tiles_amx_, int64_t grouped_loop_, int64_t ahead_, int64_t streams_)
      : w(std::move(w_)), starts(std::move(starts_)), flags(std::move(flags_)), gemv_rows(gemv_rows_),
        bits(bits_), group(group_), widen(widen_), ahead(ahead_), streams(streams_), tiles_amx(tiles_amx_),
        bf16_row(tessera_gemv::bf16_row(bf16_row_)),
        grouped_loop(static_cast<tessera_grouped::Loop>(grouped_loop_)) {
    TORCH_CHECK(grouped_loop_ >= 0 && grouped_loop_ <= 4 && tessera_grouped::runs(grouped_loop),
                "decode_stack: grouped_loop must be a loop of gemv_grouped_cpu.LOOPS this CPU runs, got ",
                grouped_loop_);
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
                "decode_stack: a projection weight must be a contiguous 2-D CPU tensor");
    TORCH_CHECK(ahead >= 0, "decode_stack: ahead must be >= 0, got ", ahead);
    TORCH_CHECK(streams == 1 || streams == 2, "decode_stack: streams must be 1 or 2, got ", streams);
    N = w.size(0);
    K = w.size(1);
    const auto t = w.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kChar || t == at::kByte,
                "decode_stack: projection weights must be float32, bfloat16, int8 or grouped uint8 codes, got ", t);
    TORCH_CHECK(s.has_value() == (t == at::kChar || t == at::kByte),
                "decode_stack: int8 and grouped weights and only they need a scale");
    TORCH_CHECK(offset_.has_value() == (t == at::kByte), "decode_stack: grouped weights and only they need an offset");
    if (t == at::kByte) {
      TORCH_CHECK((bits == 4 || bits == 8) && (group == 16 || group == 32),
                  "decode_stack: grouped weights need bits 4 or 8 and group 16 or 32");
      K = w.size(1) * 8 / bits;
      TORCH_CHECK(s->scalar_type() == at::kHalf && offset_->scalar_type() == at::kHalf && s->is_contiguous() &&
                      offset_->is_contiguous() && s->numel() == N * (K / group) && offset_->numel() == N * (K / group),
                  "decode_stack: a grouped weight's scale and offset must be float16 [N, K / group]");
      scale = *s;
      offset = *offset_;
    }
    TORCH_CHECK(starts.size() == flags.size() && (starts.empty() || starts[0] == 1),
                "decode_stack: a row rule is starts (from 1) and one flag per start");
    if (s.has_value() && t == at::kChar) scale = s->to(at::kFloat).contiguous();
    if (b.has_value()) {
      bias_model = b->contiguous();
      bias = b->to(at::kFloat).contiguous();
    }
    if (packed_.has_value()) packed = *packed_;
    if (tiles_.has_value() && tiles_amx) {
      TORCH_CHECK(t == at::kBFloat16 && tessera_amx::available() && tiles_->scalar_type() == t &&
                      tiles_->is_contiguous() && tiles_->numel() == tessera_amx::panel_size(N, K),
                  "decode_stack: AMX tiles must be widen_gemm_cpu.pack_panels of a bf16 weight, on a CPU with AMX");
      tiles = *tiles_;
    } else if (tiles_.has_value()) {
      TORCH_CHECK(tessera_tiles::fits(w) && tessera_tiles::available(t) && tiles_->scalar_type() == t &&
                      tiles_->numel() == w.numel() && tiles_->size(0) * tessera_tiles::COLS == N,
                  "decode_stack: tiles must be tile_gemm_cpu.pack of the weight, on a CPU that runs them");
      tiles = *tiles_;
    }
    TORCH_CHECK(widen == 0 || ((t == at::kChar || t == at::kByte) &&
                               (widen == 3 ? tessera_amx::available()
                                           : (widen == 1 || widen == 2) &&
                                                 tessera_widen::available(widen == 2 ? at::kBFloat16 : at::kFloat))),
                "decode_stack: widen is 1 or 2 (widen_gemm.h) or 3 (amx_gemm.h) for an int8 or grouped weight, on a "
                "CPU that runs that kernel");
    TORCH_CHECK(gemv_rows >= 0 && gemv_rows <= tessera_vec::MAX_ROWS, "decode_stack: gemv_rows must be 0 to ",
                tessera_vec::MAX_ROWS);
    TORCH_CHECK(!scale.defined() || t == at::kByte || scale.numel() == N, "decode_stack: scale must be [", N, "]");
    TORCH_CHECK(!bias.defined() || bias.numel() == N, "decode_stack: bias must be [", N, "]");
  }

  bool use_packed(int64_t M) const {
    bool p = false;
    for (size_t i = 0; i < starts.size() && starts[i] <= M; ++i) p = flags[i];
    return p && packed.defined();
  }

  // x [M, K] in the activations' dtype T @ w^T (* scale) (+ bias) -> [M, N]: fp32 in y from the few-row
  // kernel (bf16 x on bf16 weights takes its bf16 dot product) or the panels, or T in `hold` from the
  // library, which runs on T tensors as the model's Linear does. Exactly one of the result's pointers is set.
  template <typename T>
  std::pair<const float*, const T*> operator()(const T* x, float* y, int64_t M, at::Tensor& hold) const {
    constexpr auto dtype = at::CppTypeToScalarType<T>::value;
    if (tiles.defined() && M > tiles_above && tiles.scalar_type() == dtype) {
      const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
      if (tiles_amx) tessera_amx::gemm_packed(x, M, tiles.data_ptr<at::BFloat16>(), N, K, bp, y);
      else tessera_tiles::gemm(x, M, tiles.data_ptr<T>(), bp, y, N, K);
      return {y, nullptr};
    }
    if (widen && M > gemv_rows) return widened(x, y, M, hold);
    if (M > gemv_rows) {
      TORCH_CHECK(w.scalar_type() != at::kChar && w.scalar_type() != at::kByte,
                  "decode_stack: this int8 or grouped weight runs at most ", gemv_rows,
                  " rows here (its few-row kernel's; more only on widen_gemm)");
      at::Tensor xt = at::from_blob(const_cast<T*>(x), {M, K}, at::CppTypeToScalarType<T>::value);
      const bool pk = use_packed(M);
      if (pk && packed.scalar_type() != w.scalar_type()) {
        // A bf16 weight packed widened to fp32 (linear_path.pack_dtype): fp32 in, the fp32 sums out,
        // rounded where the kernel's are.
        hold = packed_linear(xt.to(at::kFloat), packed, bias).contiguous();
        return {hold.data_ptr<float>(), nullptr};
      }
      hold = (pk ? packed_linear(xt, packed, bias_model) : at::linear(xt, w, bias_model)).contiguous();
      TORCH_CHECK(hold.scalar_type() == xt.scalar_type(), "decode_stack: weights and activations differ in dtype");
      return {nullptr, hold.data_ptr<T>()};
    }
    const float* sp = scale.defined() && w.scalar_type() == at::kChar ? scale.data_ptr<float>() : nullptr;
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (w.scalar_type() == at::kBFloat16) {
        tessera_gemv::dispatch_bf16(M, x, w.data_ptr<at::BFloat16>(), bp, y, N, K, bf16_row, ahead, streams);
        return {y, nullptr};
      }
    }
    std::vector<float> widened;
    const float* xf = reinterpret_cast<const float*>(x);
    if constexpr (!std::is_same_v<T, float>) {
      widened.resize(M * K);
      for (int64_t i = 0; i < M * K; ++i) widened[i] = tessera_vec::widen(x[i]);
      xf = widened.data();
    }
    switch (w.scalar_type()) {
      case at::kFloat:
        dispatch_rows(M, xf, w.data_ptr<float>(), bp, y, N, K, ahead, streams);
        break;
      case at::kBFloat16:
        dispatch_rows(M, xf, w.data_ptr<at::BFloat16>(), bp, y, N, K, ahead, streams);
        break;
      case at::kByte: {
        const tessera_grouped::Shape sh{N, K, group, bits};
        tessera_grouped::with_rows(M, [&](auto R) {
          tessera_grouped::run<R.value>(xf, w.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
                                        offset.data_ptr<at::Half>(), bp, y, sh, grouped_loop, ahead, streams);
        });
        break;
      }
      default:
        tessera_gemv::dispatch_q8(M, xf, w.data_ptr<int8_t>(), sp, bp, y, N, K, ahead, streams);
    }
    return {y, nullptr};
  }

  // An int8 or grouped weight above its gemv_rows, on widen_gemm.h or amx_gemm.h: the call its Linear makes, so
  // the same bits. fp32 x writes y; bf16 x writes bf16 into `hold`, as the Linear returns it.
  template <typename T>
  std::pair<const float*, const T*> widened(const T* x, float* y, int64_t M, at::Tensor& hold) const {
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    T* out;
    if constexpr (std::is_same_v<T, float>) {
      out = y;
    } else {
      hold = at::empty({M, N}, at::kBFloat16);
      out = hold.data_ptr<T>();
    }
    auto run = [&](const auto& source) {
      if (widen == 3) tessera_amx::gemm(x, M, source, N, K, bp, out);
      else if constexpr (!std::is_same_v<T, float>) tessera_widen::gemm<T, T>(x, M, source, N, K, bp, out);
      else if (widen == 2) tessera_widen::gemm<float, at::BFloat16>(x, M, source, N, K, bp, out);
      else tessera_widen::gemm<float, float>(x, M, source, N, K, bp, out);
    };
    if (w.scalar_type() == at::kChar)
      run(tessera_widen::Int8Rows{w.data_ptr<int8_t>(), scale.data_ptr<float>(), K});
    else
      run(tessera_widen::Grouped{w.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), offset.data_ptr<at::Half>(), K,
                                 group, bits});
    if constexpr (std::is_same_v<T, float>) return {y, nullptr};
    else return {nullptr, out};
  }
};

// f(src) with whichever of a projection's results is set (fp32 or T), so one loop body reads either.
template <typename T, typename F>
inline void with_output(const std::pair<const float*, const T*>& out, F&& f) {
  if (out.first) {
    f(out.first);
  } else {
    f(out.second);
  }
}

}  // namespace tessera_stack
