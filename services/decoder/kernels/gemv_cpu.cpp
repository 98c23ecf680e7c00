// The few-row matmul (gemv.h) as a Python module; the launcher, its semantics and the torch reference
// are in gemv_cpu.py.
#include "gemv.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tessera_gemv;
  m.def("gemv", &gemv, "few-row matmul over fp32/bf16 weights (fp32 math) or int8 ones (x in int8 blocks)",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
}
