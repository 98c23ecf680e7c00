// The few-row matmul over grouped 4/8-bit weights (gemv_grouped.h) as a Python module; the launcher, its
// semantics and the torch reference are in gemv_grouped_cpu.py.
#include "gemv_grouped.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tessera_grouped;
  m.def("gemv_grouped", &gemv_grouped, "few-row matmul over grouped 4/8-bit weights (x in int8 per group)",
        py::arg("out"), py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("bits"),
        py::arg("group"), py::arg("bias"), py::arg("loop"), py::arg("ahead"), py::arg("streams"),
        py::call_guard<py::gil_scoped_release>());
  m.def("runs", [](int64_t loop) { return loop >= 0 && loop <= 4 && runs(static_cast<Loop>(loop)); },
        "whether this CPU runs the loop (an index of gemv_grouped_cpu.LOOPS)");
#ifdef TESSERA_GROUPED_VNNI
  m.def("vnni", []() { return true; }, "whether the pairs and chunks loops are the AVX512-VNNI ones");
#else
  m.def("vnni", []() { return false; }, "whether the pairs and chunks loops are the AVX512-VNNI ones");
#endif
}
