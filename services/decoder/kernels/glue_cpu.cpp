// The elementwise glue (glue.h) as a Python module; the launchers, their semantics and the torch
// references are in glue_cpu.py.
#include "glue.h"

#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", &tessera_glue::silu_mul, "out = SiLU(gate) * up over rows", pybind11::arg("out"),
        pybind11::arg("gate"), pybind11::arg("up"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &tessera_glue::rms_norm, "out = RMSNorm(x + y), sum = x + y", pybind11::arg("out"),
        pybind11::arg("x"), pybind11::arg("y"), pybind11::arg("sum"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
