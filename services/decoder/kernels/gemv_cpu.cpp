// The few-row matmul (gemv.h) as a Python module; the launcher, its semantics and the torch reference
// are in gemv_cpu.py.
#include "gemv.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tessera_gemv;
  m.def("gemv", &gemv, "few-row matmul over fp32/bf16 weights (fp32 math) or int8 ones (x in int8 blocks)",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("bf16_row"),
        py::arg("ahead"), py::arg("streams"), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot", [] {
#ifdef __AVX512BF16__
    return true;
#else
    return false;
#endif
  }, "whether bf16 x over bf16 weights runs gemv_bf16.h's loops (else both BF16_ROWS widen to the fp32 loop)");
}
