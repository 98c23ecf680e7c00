// The paged decode attention operator (paged_attention.h) as a Python module; the launcher, its
// semantics and the torch reference are in paged_attention_cpu.py.
#include "paged_attention.h"

#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tessera_paged;
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache, in place",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("context_lens"), pybind11::arg("rows"),
        pybind11::arg("scale"), pybind11::arg("first_keys"), pybind11::arg("softcap"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
