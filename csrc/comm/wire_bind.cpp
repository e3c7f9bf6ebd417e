// Python face of comm::Wire (See Note [The wire as a value] in comm/wire.h): pycomm.Wire and
// pycomm.WireDtype.
#include <torch/csrc/utils/pybind.h>

#include "comm/wire.h"

namespace pycomm {

namespace py = pybind11;

void bind_wire(py::module& m) {
  py::enum_<comm::WireDtype>(m, "WireDtype", "What a low-precision wire encodes each value in")
      .value("FP32", comm::WireDtype::kFloat32)
      .value("BF16", comm::WireDtype::kBFloat16)
      .value("INT8", comm::WireDtype::kInt8);
  py::class_<comm::Wire>(
      m, "Wire",
      "What a gradient all-reduce sends across hosts (DDPConfig's wire and "
      "wire_error_feedback as one value; See Note [The wire as a value] in "
      "csrc/comm/wire.h). Wire('bf16'), Wire('int8', error_feedback=True), "
      "Wire(WireDtype.INT8). Equal to its name: Wire('int8', True) == 'int8+ef'.")
      .def(py::init(&comm::Wire::parse), py::arg("wire") = "fp32",
           py::arg("error_feedback") = false)
      .def(py::init(&comm::Wire::of), py::arg("dtype"), py::arg("error_feedback") = false)
      .def_readonly("dtype", &comm::Wire::dtype)
      .def_readonly("error_feedback", &comm::Wire::error_feedback)
      .def_property_readonly("name", &comm::Wire::name,
                             "'fp32', 'bf16', 'int8', or 'int8+ef' with error feedback")
      .def_property_readonly("exact", &comm::Wire::exact, "fp32: the gradients cross as they are")
      .def("carries", &comm::Wire::carries, py::arg("dtype"),
           "whether gradients of `dtype` can cross in this wire")
      .def("__eq__", [](const comm::Wire& a, const comm::Wire& b) { return a == b; })
      .def("__eq__", [](const comm::Wire& a, const std::string& b) { return a.name() == b; })
      .def("__eq__", [](const comm::Wire&, const py::object&) { return false; })
      .def("__hash__", [](const comm::Wire& w) { return py::hash(py::str(w.name())); })
      .def("__str__", &comm::Wire::name)
      .def("__repr__",
           [](const comm::Wire& w) {
             return std::string("pycomm.Wire('") + w.dtype_name() + "'" +
                    (w.error_feedback ? ", error_feedback=True" : "") + ")";
           })
      .def(py::pickle(
          [](const comm::Wire& w) { return py::make_tuple(w.dtype_name(), w.error_feedback); },
          [](const py::tuple& t) {
            return comm::Wire::parse(t[0].cast<std::string>(), t[1].cast<bool>());
          }));
}

}  // namespace pycomm
