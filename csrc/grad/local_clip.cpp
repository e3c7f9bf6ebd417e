// Clipping each rank's local gradients before the all-reduce (DDPConfig.local_clip_max_norm):
// the reducer's launch gate (See Note [Deferred launch] in reducer/deferred.cpp). At the end
// of backward, one fused norm pass over every bucket buffer gives this rank's total norm;
// the clip coefficient, times the averaging factor the reducer skipped, scales all buckets
// in one pass; then the buckets launch. No host sync: the coefficient stays a tensor.
// See Note [Clip after vs before the all-reduce] in pycomm/clip.py for what this means.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mul.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <vector>

#include "grad/grad_math.h"
#include "reducer/reducer.h"

namespace pycomm {
namespace {

namespace py = pybind11;

class LocalClip {
 public:
  LocalClip(double max_norm, double norm_type) { set(max_norm, norm_type); }

  void set(double max_norm, double norm_type) {
    constexpr const char* who = "DistributedDataParallel local clipping";
    norm_kind(norm_type, who);
    TORCH_CHECK_VALUE(max_norm > 0, who, ": max_norm must be positive, got ", max_norm);
    std::lock_guard<std::mutex> lock(mutex_);
    max_norm_ = max_norm;
    norm_type_ = norm_type;
  }

  // The gate: runs in finalize_backward with every bucket's local gradients.
  void apply(const std::vector<at::Tensor>& buffers, double divide) {
    static auto norm_op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("pycomm::norm_partial", "")
                              .typed<at::Tensor(at::TensorList, double)>();
    static auto coef_op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("pycomm::clip_coef", "")
                              .typed<std::tuple<at::Tensor, at::Tensor>(
                                  const at::Tensor&, double, double, at::ScalarType)>();
    static auto scale_op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("pycomm::scale_", "")
                               .typed<void(at::TensorList, const at::Tensor&)>();
    double max_norm, norm_type;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      max_norm = max_norm_;
      norm_type = norm_type_;
    }
    const at::Tensor partial = norm_op.call(buffers, norm_type);
    at::ScalarType dtype = buffers.front().scalar_type();  // torch's: the grads' promotion
    for (const auto& b : buffers) dtype = c10::promoteTypes(dtype, b.scalar_type());
    auto [total, coef] = coef_op.call(partial, norm_type, max_norm, dtype);
    // One pass: the clip coefficient and the averaging factor together.
    scale_op.call(buffers, divide == 1.0 ? coef : at::mul(coef, divide));
    std::lock_guard<std::mutex> lock(mutex_);
    total_ = std::move(total);
  }

  // This rank's total local norm (before clipping) of the last synchronized backward.
  std::optional<at::Tensor> total_norm() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!total_.defined()) return std::nullopt;
    return total_;
  }

 private:
  std::mutex mutex_;
  double max_norm_ = 0.0;
  double norm_type_ = 2.0;
  at::Tensor total_;
};

}  // namespace

void bind_local_clip(py::module& m) {
  py::class_<LocalClip, std::shared_ptr<LocalClip>>(
      m, "LocalClip", "Clip local gradients before the all-reduce (local_clip.cpp)")
      .def("set", &LocalClip::set, py::arg("max_norm"), py::arg("norm_type"))
      .def("total_norm", &LocalClip::total_norm);
  m.def(
      "attach_local_clip",
      [](reducer::Reducer& r, double max_norm, double norm_type) {
        auto clip = std::make_shared<LocalClip>(max_norm, norm_type);
        r.set_launch_gate([clip](const std::vector<at::Tensor>& buffers, double divide) {
          clip->apply(buffers, divide);
        });
        return clip;
      },
      py::arg("reducer"), py::arg("max_norm"), py::arg("norm_type"),
      "Make the reducer clip this rank's gradients (all buckets) before launching them.");
}

}  // namespace pycomm
