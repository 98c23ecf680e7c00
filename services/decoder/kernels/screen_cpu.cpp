// The candidate pass of the greedy argmax screen (model/screen.py): the CPU kernel. The launcher, its
// semantics and the torch reference are in screen_cpu.py.
//
// In torch the pass is five ops over the [M, V] scores (two outer products, a max, a compare, an any):
// 5.1-6.0 ms for 64 rows of SmolLM2's 49,152 logits on 2 threads, about what the screen saves over the
// fp32 head. Here each row is read twice (its lower-bound maximum, then the rows that reach it) and only
// the few candidates are written.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace tessera_screen {

// pairs [P, 2] int64 (row, column), rows ascending and columns ascending within a row: every column c of
// row r with scores[r, c] + radius[r] * norms[c] >= max_j (scores[r, j] - radius[r] * norms[j]).
at::Tensor candidates(const at::Tensor& scores, const at::Tensor& radius, const at::Tensor& norms) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2 &&
                  scores.is_contiguous(),
              "screen.candidates: scores must be a contiguous fp32 CPU [M, V]");
  const int64_t M = scores.size(0), V = scores.size(1);
  TORCH_CHECK(radius.scalar_type() == at::kFloat && radius.is_contiguous() && radius.numel() == M,
              "screen.candidates: radius must be fp32 [", M, "]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == V,
              "screen.candidates: norms must be fp32 [", V, "]");
  const float* s = scores.data_ptr<float>();
  const float* r = radius.data_ptr<float>();
  const float* n = norms.data_ptr<float>();
  std::vector<std::vector<int64_t>> found(M);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* sr = s + row * V;
      const float rad = r[row];
      float best = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : best)
      for (int64_t c = 0; c < V; ++c) best = std::max(best, sr[c] - rad * n[c]);
      std::vector<int64_t>& out = found[row];
      for (int64_t c = 0; c < V; ++c) {
        if (sr[c] + rad * n[c] >= best) out.push_back(c);
      }
    }
  });
  int64_t total = 0;
  for (const auto& f : found) total += static_cast<int64_t>(f.size());
  at::Tensor pairs = at::empty({total, 2}, at::kLong);
  int64_t* p = pairs.data_ptr<int64_t>();
  for (int64_t row = 0; row < M; ++row) {
    for (int64_t c : found[row]) {
      *p++ = row;
      *p++ = c;
    }
  }
  return pairs;
}

}  // namespace tessera_screen

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("candidates", &tessera_screen::candidates, "(row, column) pairs that may hold a row's maximum",
        pybind11::arg("scores"), pybind11::arg("radius"), pybind11::arg("norms"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
