// pycomm._C._clip_grad_norm_: the eager fast path of pycomm.clip_grad_norm_. It takes the
// parameters and reads their .grad in C++, then runs the same composite as the
// pycomm::clip_grad_norm_ op, unboxed. Why a second entry point: a Tensor[] argument of a
// torch.ops call is boxed element by element (measured ~0.1 us per tensor here), which
// for 1,000 small gradients costs more than the clipping itself; pybind's list conversion
// and the .grad reads in C++ cost a fraction of that. The op stays the entry point for
// torch.compile, opcheck and C++ callers.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/ops/scalar_tensor.h>

#include <string>
#include <vector>

#include "grad/clip.h"
#include "grad/cpu_pieces.h"

namespace pycomm {
namespace {

// The gradients of `parameters`, read without pybind's Tensor caster: for a Parameter (a
// Python subclass) that caster's isinstance check goes through type.__instancecheck__,
// ~0.1 us per tensor, as much as the clipping of a 1,024-element gradient; a C-level
// subtype check costs a few ns.
std::vector<at::Tensor> read_grads(const pybind11::list& parameters) {
  auto* tensor_type = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  std::vector<at::Tensor> grads;
  grads.reserve(parameters.size());
  size_t i = 0;
  for (pybind11::handle item : parameters) {
    PyObject* obj = item.ptr();
    TORCH_CHECK_TYPE(PyType_IsSubtype(Py_TYPE(obj), tensor_type), "pycomm.clip_grad_norm_: "
                     "parameters[", i, "] is a ", Py_TYPE(obj)->tp_name, ", not a Tensor");
    const at::Tensor& grad = THPVariable_Unpack(obj).grad();
    if (grad.defined()) grads.push_back(grad);
    ++i;
  }
  return grads;
}

at::Tensor clip_parameters_(const pybind11::list& parameters, double max_norm,
                            double norm_type, bool error_if_nonfinite) {
  std::vector<at::Tensor> grads = read_grads(parameters);
  if (grads.empty()) return at::scalar_tensor(0.0);  // torch.tensor(0.0), as torch returns
  pybind11::gil_scoped_release no_gil;
  return clip_grad_norm_impl(grads, max_norm, norm_type, error_if_nonfinite);
}

}  // namespace

void bind_bucket_norms(pybind11::module& m);  // csrc/grad/bucket_norms.cpp
void bind_local_clip(pybind11::module& m);    // csrc/grad/local_clip.cpp

void bind_clip(pybind11::module& m) {
  bind_bucket_norms(m);
  bind_local_clip(m);
  m.def("_clip_grad_norm_", &clip_parameters_, pybind11::arg("parameters"),
        pybind11::arg("max_norm"), pybind11::arg("norm_type") = 2.0,
        pybind11::arg("error_if_nonfinite") = false,
        "pycomm.clip_grad_norm_ on a list of parameters (reads .grad in C++).");
  m.def("_cpu_kernels", [] { return std::string(cpu_pieces().name); },
        "Which build of the CPU inner loops this process runs: 'avx2' or 'default'.");
}

}  // namespace pycomm
