// Per-bucket norm partials computed during backward, for DistributedDataParallel's
// clip_grad_norm_: a post_done callback of the reducer (see BucketCallback in
// reducer/reducer.h) folds each bucket's reduced buffer into a norm partial as soon as its
// collective completes, while backward goes on. After backward only the merge of a few
// [acc, nonfinite] pairs, clip_coef and one scale pass remain. A composed piece: the
// reducer knows nothing of norms. No collective launched (no_sync) means nothing computed.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "grad/grad_math.h"
#include "reducer/reducer.h"

namespace pycomm {
namespace {

namespace py = pybind11;

class BucketNorms {
 public:
  explicit BucketNorms(double norm_type) { set_norm_type(norm_type); }

  // Applies to buckets completing from now on; partials of another order are discarded.
  void set_norm_type(double norm_type) {
    norm_kind(norm_type, "DistributedDataParallel.clip_grad_norm_");
    std::lock_guard<std::mutex> lock(mutex_);
    norm_type_ = norm_type;
  }

  // post_done: runs on the thread completing the bucket's collective.
  void on_done(const reducer::Bucket& bucket) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("pycomm::norm_partial", "")
                         .typed<at::Tensor(at::TensorList, double)>();
    double p;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      p = norm_type_;
    }
    // In place (See Note [Gradients reduced in place]): the reduced values are the grads.
    at::Tensor partial = in_place(bucket.path) ? op.call(bucket.grads, p)
                                               : op.call({bucket.buffer}, p);
    std::lock_guard<std::mutex> lock(mutex_);
    if (partials_.size() <= bucket.index) partials_.resize(bucket.index + 1);
    partials_[bucket.index] = Entry{std::move(partial), p};
  }

  // True when buckets 0..num_buckets-1 all hold a partial of `norm_type` not yet taken.
  bool complete(size_t num_buckets, double norm_type) {
    std::lock_guard<std::mutex> lock(mutex_);
    return complete_locked(num_buckets, norm_type);
  }

  // The merged partial of the last synchronized backward (See Note [Norm partials]), or
  // nothing if a bucket is missing; either way every stored partial is consumed, so a
  // partial is never used for two steps.
  std::optional<at::Tensor> take(size_t num_buckets, double norm_type) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::optional<at::Tensor> out;
    if (complete_locked(num_buckets, norm_type)) {
      std::vector<at::Tensor> parts;
      for (size_t i = 0; i < num_buckets; ++i) parts.push_back(partials_[i]->partial);
      const at::Tensor stacked = at::stack(parts);
      out = norm_kind(norm_type, "take") == NormKind::kInf ? at::amax(stacked, 0)
                                                           : at::sum(stacked, 0);
    }
    partials_.clear();
    return out;
  }

 private:
  struct Entry {
    at::Tensor partial;
    double norm_type;
  };

  bool complete_locked(size_t num_buckets, double norm_type) const {
    if (num_buckets == 0 || partials_.size() < num_buckets) return false;
    for (size_t i = 0; i < num_buckets; ++i)
      if (!partials_[i] || partials_[i]->norm_type != norm_type) return false;
    return true;
  }

  std::mutex mutex_;
  double norm_type_ = 2.0;
  std::vector<std::optional<Entry>> partials_;
};

}  // namespace

void bind_bucket_norms(py::module& m) {
  py::class_<BucketNorms, std::shared_ptr<BucketNorms>>(
      m, "BucketNorms", "Per-bucket norm partials computed during backward (bucket_norms.cpp)")
      .def("set_norm_type", &BucketNorms::set_norm_type, py::arg("norm_type"))
      .def("complete", &BucketNorms::complete, py::arg("num_buckets"), py::arg("norm_type"))
      .def("take", &BucketNorms::take, py::arg("num_buckets"), py::arg("norm_type"));
  m.def(
      "attach_bucket_norms",
      [](reducer::Reducer& r, double norm_type) {
        auto norms = std::make_shared<BucketNorms>(norm_type);
        r.add_post_done([norms](reducer::Bucket& b) { norms->on_done(b); },
                        /*reads_buffer=*/false);
        return norms;
      },
      py::arg("reducer"), py::arg("norm_type"),
      "Register a post_done callback computing each bucket's norm partial; returns its store.");
}

}  // namespace pycomm
