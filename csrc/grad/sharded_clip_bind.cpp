// pycomm._C._sharded_grads: the per-step walk of pycomm.clip_grad_norm_ over DTensor
// gradients (pycomm/fsdp/clip.py, Note [Clipping sharded gradients]) in one C++ call. For
// each parameter it reads .grad, the DTensor's spec and local tensor, finds the spec's slot
// (the plan Python decided for it, by the spec's identity) and adds the local tensor to
// that slot's span list; then the norm partial of every slot in one pass each (float64,
// never rounded to float32) and, once Python has the coefficient, the scale pass over every
// local tensor. Timed on 2,000 FSDP2 gradients of 136 elements (1 rank, 1 thread): the
// same walk in Python, with the norm and scale through torch.ops (boxing each tensor of a
// Tensor[] argument), cost ~5 ms a call; see benchmarks/results/fsdp2_clip_cpu.md.
#include <ATen/ops/zeros.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <vector>

#include "grad/cpu_lists.h"
#include "grad/span_list.h"

namespace pycomm {
namespace {

// One step's local gradient tensors, grouped by slot, held (a reference each) from the walk
// to the scale.
class ShardedGrads {
 public:
  explicit ShardedGrads(int64_t slots) : by_slot_(static_cast<size_t>(slots)) {}

  void add(int64_t slot, at::Tensor local) {
    const at::ScalarType dtype = local.scalar_type();
    norm_dtype_ = locals_.empty() ? dtype : c10::promoteTypes(norm_dtype_, dtype);
    by_slot_[static_cast<size_t>(slot)].add(local.mutable_data_ptr(), local.numel(), dtype,
                                            locals_.size());
    all_.add(local.mutable_data_ptr(), local.numel(), dtype, locals_.size());
    present_.resize(by_slot_.size(), false);
    present_[static_cast<size_t>(slot)] = true;
    locals_.push_back(std::move(local));
  }

  // [slots, 2] float64: each slot's [sum |g|^p (max |g| for inf, NaN propagated),
  // nonfinite]; a slot no gradient of this call uses holds zeros.
  at::Tensor partials(double norm_type) const {
    const NormKind kind = norm_kind(norm_type, "pycomm.clip_grad_norm_");
    at::Tensor rows = at::zeros({static_cast<int64_t>(by_slot_.size()), 2},
                                at::TensorOptions(at::kDouble));
    double* out = rows.mutable_data_ptr<double>();
    pybind11::gil_scoped_release no_gil;  // the tensors are held: nothing can free them
    for (size_t s = 0; s < by_slot_.size(); ++s)
      if (by_slot_[s].total() > 0) norm_partial_spans(by_slot_[s], kind, norm_type, out + 2 * s);
    return rows;
  }

  // Multiplies every local tensor by coef (a one-element CPU tensor); nothing when it is 1.
  void scale(const at::Tensor& coef) const {
    TORCH_CHECK(coef.numel() == 1 && coef.device().is_cpu(),
                "pycomm.clip_grad_norm_: the coefficient must be one element on the CPU");
    const double c = coef.item<double>();
    if (c == 1.0) return;
    pybind11::gil_scoped_release no_gil;
    scale_spans(all_, c);
  }

  // The slots this call's gradients use, in slot order.
  std::vector<int64_t> present() const {
    std::vector<int64_t> out;
    for (size_t s = 0; s < present_.size(); ++s)
      if (present_[s]) out.push_back(static_cast<int64_t>(s));
    return out;
  }

  at::ScalarType norm_dtype() const { return norm_dtype_; }
  bool empty() const { return locals_.empty(); }

 private:
  std::vector<SpanList> by_slot_;
  SpanList all_;
  std::vector<bool> present_;
  std::vector<at::Tensor> locals_;
  at::ScalarType norm_dtype_ = at::kFloat;
};

// Whether `t` can be read and written through its data pointer here: a dense floating CPU
// tensor of the plain kind. (Anything else takes the Python walk, which goes through the
// dispatcher: CUDA local tensors, say.)
bool plain_cpu(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return impl->device_type() == c10::DeviceType::CPU && impl->layout() == c10::kStrided &&
         !impl->is_python_dispatch() && at::isFloatingType(t.scalar_type()) && is_flat_span(t) &&
         impl->has_storage();
}

// Whether obj is a Tensor, by a C-level subtype check: THPVariable_Check asks the type's
// __instancecheck__, which nn.Parameter's metaclass answers in Python (~0.5 us a call, a
// third of the walk's time on 2,000 FSDP2 parameters).
bool is_tensor(PyObject* obj) {
  return PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// parameters: the list pycomm.clip_grad_norm_ got; slot_of: {id(spec): slot index}, a
// negative index meaning "the Python walk" (a Partial placement). Returns a ShardedGrads;
// or the list of specs slot_of lacks (Python decides their slots and calls again); or None
// where the Python walk must take over (a gradient that is not a DTensor, a local tensor
// that is not a plain CPU one, a negative slot).
pybind11::object sharded_grads(const pybind11::list& parameters, const pybind11::dict& slot_of,
                               int64_t slots) {
  static PyObject* const spec_name = PyUnicode_InternFromString("_spec");
  static PyObject* const local_name = PyUnicode_InternFromString("_local_tensor");
  auto walk = std::make_unique<ShardedGrads>(slots);
  pybind11::list unknown;
  for (size_t i = 0; i < parameters.size(); ++i) {
    PyObject* param = PyList_GET_ITEM(parameters.ptr(), i);
    if (!is_tensor(param)) return pybind11::none();
    // TensorImpl::grad(): Tensor::grad() asks autograd whether the tensor is a leaf on
    // every read (See clip_bind.cpp's grad_of)
    const at::Tensor& grad = THPVariable_Unpack(param).unsafeGetTensorImpl()->grad();
    if (!grad.defined()) continue;
    if (!grad.unsafeGetTensorImpl()->is_python_dispatch()) return pybind11::none();
    auto obj = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(grad));
    auto spec = pybind11::reinterpret_steal<pybind11::object>(PyObject_GetAttr(obj.ptr(),
                                                                               spec_name));
    auto local = pybind11::reinterpret_steal<pybind11::object>(PyObject_GetAttr(obj.ptr(),
                                                                                local_name));
    if (!spec || !local) {  // not a DTensor
      PyErr_Clear();
      return pybind11::none();
    }
    auto key = pybind11::reinterpret_steal<pybind11::object>(PyLong_FromVoidPtr(spec.ptr()));
    PyObject* slot = PyDict_GetItemWithError(slot_of.ptr(), key.ptr());
    if (slot == nullptr) {
      if (PyErr_Occurred()) throw pybind11::error_already_set();
      unknown.append(spec);
      continue;
    }
    const int64_t s = PyLong_AsLongLong(slot);
    if (s < 0 || s >= slots || !is_tensor(local.ptr())) return pybind11::none();
    const at::Tensor& t = THPVariable_Unpack(local.ptr());
    if (!plain_cpu(t)) return pybind11::none();
    walk->add(s, t);
  }
  if (!unknown.empty()) return std::move(unknown);
  return pybind11::cast(std::move(walk));
}

}  // namespace

void bind_sharded_clip(pybind11::module& m) {
  pybind11::class_<ShardedGrads>(m, "_ShardedGrads",
                                 "One step's DTensor local gradients grouped by slot "
                                 "(pycomm/fsdp/clip.py).")
      .def("partials", &ShardedGrads::partials, pybind11::arg("norm_type"))
      .def("scale", &ShardedGrads::scale, pybind11::arg("coef"))
      .def("present", &ShardedGrads::present)
      .def("empty", &ShardedGrads::empty)
      .def_property_readonly("norm_dtype", [](const ShardedGrads& g) {
        return pybind11::reinterpret_borrow<pybind11::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(g.norm_dtype())));
      });
  m.def("_sharded_grads", &sharded_grads, pybind11::arg("parameters"), pybind11::arg("slot_of"),
        pybind11::arg("slots"),
        "The DTensor gradients of `parameters` grouped by slot ({id(spec): slot}) as a "
        "_ShardedGrads; or the specs slot_of lacks; or None where the Python walk must take "
        "over.");
}

}  // namespace pycomm
