// Clipping each rank's local gradients before the all-reduce (DDPConfig.local_clip_max_norm):
// the reducer's launch gate (See Note [Deferred launch] in reducer/deferred.cpp). At the end
// of backward, one fused norm pass over every bucket buffer gives this rank's total norm;
// the clip coefficient, times the averaging factor the reducer skipped, scales all buckets
// in one pass; then the buckets launch. No host sync: the coefficient stays a tensor,
// except with error_if_nonfinite (See Note [Non-finite local norm]).
// See Note [Clip after vs before the all-reduce] in pycomm/ddp/clip.py for what this means.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "comm/c10d.h"
#include "grad/clip.h"
#include "grad/grad_math.h"
#include "reducer/reducer.h"

namespace pycomm {
namespace {

namespace py = pybind11;

class LocalClip {
 public:
  LocalClip(double max_norm, double norm_type, bool error_if_nonfinite, comm::ProcessGroupPtr pg)
      : error_if_nonfinite_(error_if_nonfinite), pg_(std::move(pg)) {
    set(max_norm, norm_type);
  }

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
    // The one finish (See Note [One clip finish] in grad/clip.h), but for its refusal: this
    // clip's is collective (Note [Non-finite local norm]).
    auto [total, coef] = finish_clip(partial, max_norm, norm_type, /*error_if_nonfinite=*/false,
                                     dtype);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      total_ = total;
    }
    if (error_if_nonfinite_) check_finite_everywhere(total, norm_type);
    // One pass: the clip coefficient and the averaging factor together.
    scale_op.call(buffers, divide == 1.0 ? coef : at::mul(coef, divide));
  }

  // This rank's total local norm (before clipping) of the last synchronized backward.
  std::optional<at::Tensor> total_norm() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!total_.defined()) return std::nullopt;
    return total_;
  }

 private:
  // Note [Non-finite local norm]
  // local_clip_error_if_nonfinite (torch's error_if_nonfinite for the local clip): every
  // rank must raise in the same step, or the others would launch buckets that this rank
  // never matches and wait out the group timeout. So each rank puts its "non-finite" flag
  // in its slot of a world-sized vector, one all-reduce sums them (before any bucket
  // launches; a joined rank shadows it with zeros, pycomm/ddp/join.py), and after a host
  // sync (torch's error_if_nonfinite syncs too) every rank raises: a bad rank with torch's
  // words (what torch's clip_grad_norm_ raises on its gradients), the others naming it.
  // Nothing was scaled or launched: each rank's grads are its local, unclipped ones, as
  // torch's clip_grad_norm_ leaves them when it raises. A rank that never gets here (it
  // died) makes the others' all-reduce fail within the group timeout.
  void check_finite_everywhere(const at::Tensor& total, double norm_type) {
    const int rank = pg_->getRank();
    at::Tensor flags = at::zeros({pg_->getSize()}, total.options().dtype(at::kFloat));
    flags.select(0, rank).copy_(at::isfinite(total).logical_not());
    auto future = comm::start_allreduce(pg_, flags, c10d::ReduceOp::SUM)->getFuture();
    future->wait();
    TORCH_CHECK(!future->hasError(), "pycomm DDP local clipping (rank ", rank,
                "): the all-reduce of the non-finite flags failed: ", comm::error_message(*future));
    const at::Tensor host = flags.to(at::kCPU);
    const float* flag = host.data_ptr<float>();
    std::ostringstream bad;
    for (int64_t r = 0; r < host.numel(); ++r) {
      if (flag[r] != 0.0f) bad << (bad.tellp() > 0 ? ", " : "") << r;
    }
    if (bad.tellp() == 0) return;
    constexpr const char* left = "; nothing was reduced: every rank's gradients are its local, "
                                 "unclipped ones";
    // torch's words, as its clip_grad_norm_ would raise them on this rank's gradients
    TORCH_CHECK(flag[rank] == 0.0f, "pycomm DDP local clipping (rank ", rank,
                "), this rank's local norm is ", std::isnan(total.item<double>()) ? "nan" : "inf",
                ": ", nonfinite_norm_message(norm_type),
                " (DDPConfig.local_clip_error_if_nonfinite here)", left);
    TORCH_CHECK(false, "pycomm DDP local clipping (rank ", rank, "): rank(s) ", bad.str(),
                " had a non-finite local gradient norm "
                "(DDPConfig.local_clip_error_if_nonfinite=True)",
                left);
  }

  const bool error_if_nonfinite_;
  const comm::ProcessGroupPtr pg_;
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
      [](reducer::Reducer& r, double max_norm, double norm_type, bool error_if_nonfinite) {
        auto clip = std::make_shared<LocalClip>(max_norm, norm_type, error_if_nonfinite,
                                                r.process_group());
        r.set_launch_gate([clip](const std::vector<at::Tensor>& buffers, double divide) {
          clip->apply(buffers, divide);
        });
        return clip;
      },
      py::arg("reducer"), py::arg("max_norm"), py::arg("norm_type"),
      py::arg("error_if_nonfinite") = false,
      "Make the reducer clip this rank's gradients (all buckets) before launching them.");
}

}  // namespace pycomm
