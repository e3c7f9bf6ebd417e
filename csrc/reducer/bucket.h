// Buckets: which parameters share one flat gradient buffer, the buffer itself, the
// per-parameter views into it, and each bucket's per-step state. Owns layout only;
// readiness, launch and finalize live in reducer.{h,cpp}.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/wire.h"

namespace pycomm::reducer {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// Note [Bucket paths]
// What the reducer does with a bucket in a step is one of four paths: the plan's
// (Plan::paths, decided from the options, the communication hook and the group: Note [The
// reducer's plan] in plan.h), taken when the step's backward begins
// (Reducer::begin_backward_locked), and left for kBuffer / kReleased only when the step's
// gradients do not qualify for the in-place path (Reducer::leave_in_place). Two questions make it:
// - where the collective reads and writes: the bucket's buffer, which each gradient is
//   copied into (torch's way), or the gradients where they are (Note [Gradients reduced
//   in place] in in_place.cpp);
// - who takes the result: finalize, which copies it into param.grad (torch's way), or
//   the communication hook, which keeps it (a sharded optimizer's range) while the
//   gradients are dropped (Note [Released gradients] in launch.cpp).
enum class BucketPath : uint8_t {
  kBuffer,           // copied in, reduced in the buffer, copied back by finalize
  kInPlace,          // reduced where the gradients are; nothing to copy either way
  kReleased,         // copied in and dropped; the hook keeps the result
  kReleasedInPlace,  // reduced where they are, the hook keeps the result; then dropped
};

inline bool in_place(BucketPath path) {
  return path == BucketPath::kInPlace || path == BucketPath::kReleasedInPlace;
}

inline bool releases(BucketPath path) {
  return path == BucketPath::kReleased || path == BucketPath::kReleasedInPlace;
}

// The path a bucket takes when it leaves the in-place path for the step.
inline BucketPath through_buffer(BucketPath path) {
  return releases(path) ? BucketPath::kReleased : BucketPath::kBuffer;
}

// One flat, contiguous buffer holding the gradients of `params` (reducer parameter
// indices) back to back, in bucket order.
struct Bucket {
  size_t index = 0;
  at::Tensor buffer;
  std::vector<size_t> params;
  std::vector<size_t> offsets;        // in elements, per slot
  std::vector<size_t> lengths;        // numel, per slot
  std::vector<at::Tensor> views;      // per slot: `buffer` seen with the parameter's shape
  std::vector<c10::IntArrayRef> sizes;  // per slot, refs to the parameters' sizes

  // Per-step state, reset by reset_step.
  size_t pending = 0;           // gradients still to land
  size_t unused = 0;            // parameters unused this step (skip_all_reduce_unused_params)
  bool skipped = false;         // not reduced this step (all its parameters unused)
  std::vector<size_t> deferred;  // slots whose copy waits for the bucket (batched copy)
  // This step's path (See Note [Bucket paths]); reduced in place, from launch to
  // finalize `grads` are the tensors reduced.
  BucketPath path = BucketPath::kBuffer;
  std::vector<at::Tensor> grads;
  FuturePtr future;  // completes after post_done (with the buffer, stale if in place)
  int64_t ready_ns = -1;
  int64_t launch_ns = -1;
  std::atomic<int64_t> done_ns{-1};
  int64_t ready_stamp = -1;               // device event ids (see Note [Timeline])
  std::atomic<int64_t> done_stamp{-1};
  // The low-precision wire's error feedback of this bucket's all-reduces (Note
  // [Low-precision wire] in shm/wire_codec.h), made by the first that needs it: a rebuilt
  // bucket starts again from zero.
  std::shared_ptr<comm::WireResidual> wire_residual;

  int64_t nbytes() const { return buffer.numel() * static_cast<int64_t>(buffer.element_size()); }
  void reset_step();
};

// Greedy assignment in `order` (reducer parameter indices), one open bucket per
// (device, dtype): a bucket closes once it holds at least its byte limit. The k-th bucket
// of a key uses byte_limits[k] (the last limit repeats). Buckets are returned in the order
// their first parameter appears in `order`, which is the launch order.
//
// `groups` (per parameter; empty: each parameter alone) names gradient groups, parameters
// whose gradients become ready together (See Note [Gradient groups] in rebuild.cpp): a
// bucket closes inside a group only if the rest of the group still fills the next bucket,
// so every group ends a bucket unless the bucket is still under its limit there.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                const std::vector<size_t>& order,
                                                const std::vector<int64_t>& byte_limits,
                                                const std::vector<int64_t>& groups = {});

// Give `buffer`'s storage the bytes it views again after release_storage (in place: its
// views stay valid), or nothing when it has them.
void ensure_storage(const at::Tensor& buffer);
// Free `buffer`'s storage; its views keep their shapes and offsets (See Note [Bucket memory]).
void release_storage(const at::Tensor& buffer);

// Allocate the buffers of `assignment`. A bucket's dtype is the parameters' dtype, or
// `grad_reduce_dtype` when given (fp32 reduction of low-precision parameters).
std::vector<std::unique_ptr<Bucket>> build_buckets(
    const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
    const std::vector<std::vector<size_t>>& assignment,
    std::optional<at::ScalarType> grad_reduce_dtype);

// The buckets of the current layout and where each parameter's gradient lives in them
// (bucket, slot). Laid out again only outside backward (Reducer::rebuild_buckets).
class BucketLayout {
 public:
  // Lay out `assignment` (see build_buckets). With `grads_as_views`
  // (gradient_as_bucket_view), a parameter's existing grad of its bucket's dtype is copied
  // into its slot and becomes the slot's view.
  void build(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
             const std::vector<std::vector<size_t>>& assignment,
             std::optional<at::ScalarType> grad_reduce_dtype, bool grads_as_views);

  const std::vector<std::unique_ptr<Bucket>>& buckets() const { return buckets_; }
  size_t size() const { return buckets_.size(); }
  Bucket& operator[](size_t bucket) const { return *buckets_[bucket]; }
  Bucket& bucket_of(size_t index) const { return *buckets_[locator_[index].first]; }
  size_t slot_of(size_t index) const { return locator_[index].second; }
  // The bucket view holding parameter `index`'s gradient.
  const at::Tensor& view(size_t index) const {
    const auto [bucket, slot] = locator_[index];
    return buckets_[bucket]->views[slot];
  }
  c10::Device device() const { return buckets_.front()->buffer.device(); }
  void reset_step() {
    for (auto& bucket : buckets_) bucket->reset_step();
  }

 private:
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::pair<size_t, size_t>> locator_;  // param -> (bucket, slot)
};

}  // namespace pycomm::reducer
