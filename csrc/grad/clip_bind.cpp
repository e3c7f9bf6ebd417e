// pycomm._C._clip_grad_norm_: the eager fast path of pycomm.clip_grad_norm_. It takes the
// parameters and reads their .grad in C++, then runs the same composite as the
// pycomm::clip_grad_norm_ op, unboxed. Why a second entry point: a Tensor[] argument of a
// torch.ops call is boxed element by element (measured ~0.1 us per tensor here), which
// for 1,000 small gradients costs more than the clipping itself; pybind's list conversion
// and the .grad reads in C++ cost a fraction of that. The op stays the entry point for
// torch.compile, opcheck and C++ callers. Plain CPU gradients skip even the composite:
// See Note [Clip straight from the parameters].
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/impl/COW.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "grad/clip.h"
#include "grad/cpu_lists.h"
#include "grad/cpu_pieces.h"
#include "grad/span_list.h"

namespace pycomm {
namespace {

// Note [Clip straight from the parameters]
// What a call costs besides its passes over memory, timed on 1,000 one-element fp32
// gradients (1 thread, warm): 72 us through the composite (a Tensor refcount taken and
// dropped per gradient, three dispatcher calls each collecting the dispatch keys of all
// 1,000 tensors, the checks and the span list built once per op, partial and coefficient
// passed through tensors), 45 us here. For the common case (every gradient a dense floating
// CPU tensor on its own storage) clip_params_cpu walks the parameters once, building the
// span list as it reads each .grad, then runs the composite's passes (cpu_lists.h: same
// chunks, same coefficient arithmetic, so the same results bit for bit). Anything else
// (CUDA, strided views, Python tensor subclasses, copy-on-write storage) takes the
// composite. Nothing is cached between calls: a cache would have to be validated against
// each parameter's current .grad, its storage and size, i.e. the same pointer chase
// (parameter -> AutogradMeta -> grad -> StorageImpl) that building the list costs.
// Below kHoldGilBytes the GIL is held throughout, so no other thread can replace or free a
// .grad under the passes and no reference needs taking; above it, the passes take long
// enough to hold references and release the GIL.

// The GIL is held through the passes under this many bytes of gradients: ~0.3 ms at
// cache bandwidth, far below Python's 5 ms switch interval.
constexpr int64_t kHoldGilBytes = 8 << 20;

// parameters[i].grad (undefined where it has none).
const at::Tensor& grad_of(PyObject* obj, size_t i) {
  // A C-level subtype check: pybind's Tensor caster goes through type.__instancecheck__
  // for a Parameter (a Python subclass), ~0.1 us per tensor.
  auto* tensor_type = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  TORCH_CHECK_TYPE(PyType_IsSubtype(Py_TYPE(obj), tensor_type),
                   "pycomm.clip_grad_norm_: "
                   "parameters[",
                   i, "] is a ", Py_TYPE(obj)->tp_name, ", not a Tensor");
  const at::Tensor& param = THPVariable_Unpack(obj);
  // TensorImpl::grad() first: Tensor::grad() asks autograd whether the tensor is a leaf
  // (a virtual call) on every read, for a warning it gives only when there is no grad.
  const at::Tensor& grad = param.unsafeGetTensorImpl()->grad();
  return grad.defined() ? grad : param.grad();
}

// The gradients of `parameters` (those that have one).
std::vector<at::Tensor> read_grads(const pybind11::list& parameters) {
  std::vector<at::Tensor> grads;
  grads.reserve(parameters.size());
  for (size_t i = 0; i < parameters.size(); ++i) {
    const at::Tensor& grad = grad_of(PyList_GET_ITEM(parameters.ptr(), i), i);
    if (grad.defined()) grads.push_back(grad);
  }
  return grads;
}

// Whether clip_params_cpu may read and write `t` through its data pointer: a dense floating
// CPU tensor of the plain kind, on its own (not copy-on-write) storage.
bool is_plain_cpu_span(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return impl->device_type() == c10::DeviceType::CPU && impl->layout() == c10::kStrided &&
         !impl->is_python_dispatch() && at::isFloatingType(t.scalar_type()) && is_flat_span(t) &&
         impl->has_storage() && !c10::impl::cow::is_cow_data_ptr(impl->storage().data_ptr());
}

// See Note [Clip straight from the parameters]. nullopt: some gradient needs the composite.
std::optional<at::Tensor> clip_params_cpu(const pybind11::list& parameters, double max_norm,
                                          double norm_type, bool error_if_nonfinite) {
  const NormKind kind = norm_kind(norm_type, "pycomm::clip_grad_norm_");
  SpanList l;
  l.reserve(parameters.size());
  size_t count = 0;
  at::ScalarType norm_dtype = at::kFloat;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const at::Tensor& g = grad_of(PyList_GET_ITEM(parameters.ptr(), i), i);
    if (!g.defined()) continue;
    if (!is_plain_cpu_span(g)) return std::nullopt;
    const at::ScalarType dtype = g.scalar_type();
    // torch's total norm has the promotion of the gradients' dtypes (clip.cpp's norm_dtype).
    norm_dtype = count++ == 0 ? dtype : c10::promoteTypes(norm_dtype, dtype);
    l.add(const_cast<void*>(g.const_data_ptr()), g.numel(), dtype, i);
  }
  if (count == 0) return at::scalar_tensor(0.0);  // torch.tensor(0.0), as torch returns
  int64_t bytes = 0;
  for (const Span& s : l.spans) bytes += s.numel * static_cast<int64_t>(elementSize(s.dtype));
  std::optional<std::vector<at::Tensor>> keep;
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (bytes >= kHoldGilBytes) {
    keep.emplace(read_grads(parameters));
    no_gil.emplace();
  }
  at::Tensor partial = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  norm_partial_spans(l, kind, norm_type, partial.mutable_data_ptr<double>());
  // The one finish (See Note [One clip finish] in clip.h) of the partial in float64. (The
  // composite's is rounded to float32 unless a gradient is float64, and then the norm's
  // opmath type is float32 too: rounding it here first would change nothing.)
  const ClipFinish finish = finish_clip(partial, max_norm, norm_type, error_if_nonfinite,
                                        norm_dtype);
  const double coef = finish.coef.scalar_type() == at::kDouble
                          ? *finish.coef.const_data_ptr<double>()
                          : *finish.coef.const_data_ptr<float>();  // opmath: float or double
  if (coef != 1.0) scale_spans(l, coef);  // clipping inactive: no pass over memory at all
  return finish.total;
}

// Whether the CUDA clip may take `t` as a span: a dense floating tensor of the plain kind on
// `device` (the first gradient's).
bool is_plain_cuda_span(const at::Tensor& t, c10::Device device) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return impl->device_type() == c10::DeviceType::CUDA && t.device() == device &&
         impl->layout() == c10::kStrided && !impl->is_python_dispatch() &&
         at::isFloatingType(t.scalar_type()) && is_flat_span(t) && impl->has_storage();
}

// Gradients all on one CUDA device, dense, and no nonfinite check (which needs the norm on
// the host before scaling): the two-launch clip of Note [Tile plans], its spans read from
// the parameters with the GIL held and no reference taken (the launches only enqueue work;
// the caching allocator orders a freed gradient's reuse after it on this stream).
// nullopt: the composite.
std::optional<at::Tensor> clip_params_cuda(const pybind11::list& parameters, double max_norm,
                                           double norm_type, bool error_if_nonfinite) {
  const CudaClip* cuda = cuda_clip();
  if (cuda == nullptr || error_if_nonfinite) return std::nullopt;
  SpanList l;
  l.reserve(parameters.size());
  std::optional<c10::Device> device;
  at::ScalarType norm_dtype = at::kFloat;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const at::Tensor& g = grad_of(PyList_GET_ITEM(parameters.ptr(), i), i);
    if (!g.defined()) continue;
    if (!device) {
      if (!g.is_cuda()) return std::nullopt;
      device = g.device();
      norm_dtype = g.scalar_type();
    }
    if (!is_plain_cuda_span(g, *device)) return std::nullopt;
    norm_dtype = c10::promoteTypes(norm_dtype, g.scalar_type());
    l.add(const_cast<void*>(g.const_data_ptr()), g.numel(), g.scalar_type(), i);
  }
  if (!device) return std::nullopt;
  return cuda->clip(l, *device, max_norm, norm_type, norm_dtype);
}

// nullopt: a gradient is a Python tensor subclass (a DTensor, say), which pycomm.clip_grad_norm_
// takes in Python (pycomm/fsdp/clip.py), so that the common case never pays for looking.
std::optional<at::Tensor> clip_parameters_(const pybind11::list& parameters, double max_norm,
                                           double norm_type, bool error_if_nonfinite) {
  if (auto total = clip_params_cpu(parameters, max_norm, norm_type, error_if_nonfinite))
    return total;
  if (auto total = clip_params_cuda(parameters, max_norm, norm_type, error_if_nonfinite))
    return total;
  for (size_t i = 0; i < parameters.size(); ++i) {  // DTensors, say: no list of them to build
    const at::Tensor& g = grad_of(PyList_GET_ITEM(parameters.ptr(), i), i);
    if (g.defined()) {
      if (g.unsafeGetTensorImpl()->is_python_dispatch()) return std::nullopt;
      break;
    }
  }
  std::vector<at::Tensor> grads = read_grads(parameters);
  if (grads.empty()) return at::scalar_tensor(0.0);  // torch.tensor(0.0), as torch returns
  for (const at::Tensor& g : grads)
    if (g.unsafeGetTensorImpl()->is_python_dispatch()) return std::nullopt;
  pybind11::gil_scoped_release no_gil;
  return clip_grad_norm_impl(grads, max_norm, norm_type, error_if_nonfinite);
}

}  // namespace

std::string adam_route(const std::string& want);  // adam_cpu.cpp

void bind_clip(pybind11::module& m) {
  m.def("_clip_grad_norm_", &clip_parameters_, pybind11::arg("parameters"),
        pybind11::arg("max_norm"), pybind11::arg("norm_type") = 2.0,
        pybind11::arg("error_if_nonfinite") = false,
        "pycomm.clip_grad_norm_ on a list of parameters (reads .grad in C++); None when a "
        "gradient is a Python tensor subclass (e.g. a DTensor), which it leaves untouched.");
  m.def(
      "_finish_clip",
      [](const at::Tensor& partial, double max_norm, double norm_type, bool error_if_nonfinite,
         at::ScalarType norm_dtype) {
        ClipFinish finish = finish_clip(partial, max_norm, norm_type, error_if_nonfinite,
                                        norm_dtype);
        return std::make_tuple(std::move(finish.total), std::move(finish.coef));
      },
      pybind11::arg("partial"), pybind11::arg("max_norm"), pybind11::arg("norm_type"),
      pybind11::arg("error_if_nonfinite"), pybind11::arg("norm_dtype"),
      pybind11::call_guard<pybind11::gil_scoped_release>(),
      "(total norm in norm_dtype, clip coefficient) of a merged norm partial, refusing a "
      "non-finite total as torch does under error_if_nonfinite: the one finish of every "
      "clip (Note [One clip finish] in csrc/grad/clip.h).");
  m.def(
      "_tile_plans",
      []() -> std::optional<std::pair<int64_t, int64_t>> {
        if (cuda_clip() == nullptr) return std::nullopt;
        return cuda_clip()->plan_counts();
      },
      "(tile plans cached, of them pinned by a CUDA graph), or None in a build without CUDA "
      "(Note [Tile plans] in csrc/grad/clip_cuda.cu).");
  m.def(
      "_clear_tile_plans",
      [] {
        if (cuda_clip() != nullptr) cuda_clip()->clear_plans();
      },
      "Drops the tile plans no CUDA graph uses.");
  m.def(
      "_cpu_kernels", [] { return std::string(cpu_pieces().name); },
      "Which build of the CPU inner loops this process runs: 'avx2' or 'default'.");
  m.def("_adam_route", &adam_route, pybind11::arg("want") = "",
        "Where pycomm::adam_step_ takes its square roots, 'mkl' or 'aten', after setting it to "
        "want ('' leaves it, 'auto' restores the default): Note [Adam in chunks, two at a "
        "time] in csrc/grad/adam_cpu.cpp.");
}

}  // namespace pycomm
