// The whole c10d surface pycomm's C++ uses, in one place: c10d's API moves between
// torch releases, so every call into it goes through here, guarded by version checks.
#pragma once

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <string>
#include <vector>

#include "comm/op_label.h"
#include "comm/wire.h"

#define PYCOMM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

static_assert(PYCOMM_TORCH_AT_LEAST(2, 4), "pycomm needs torch >= 2.4");

// What c10d::Backend offers a backend to override, by the torch release that brought it.
// gather_single: the gather into one tensor.
#define PYCOMM_C10D_GATHER_SINGLE PYCOMM_TORCH_AT_LEAST(2, 14)
// registerAbortHook / unregisterAbortHook.
#define PYCOMM_C10D_ABORT_HOOKS PYCOMM_TORCH_AT_LEAST(2, 14)
// Completion hooks, and the queries supportsAbortHooks / supportsCompletionHooks.
#define PYCOMM_C10D_COMPLETION_HOOKS PYCOMM_TORCH_AT_LEAST(2, 15)

namespace pycomm::comm {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// "sum" | "avg" | "max" | "min" | "product" -> c10d::ReduceOp; anything else is an error
// that names the op.
c10d::ReduceOp reduce_op(const std::string& name);

// The group's backend for CPU tensors, or null when it has none.
c10::intrusive_ptr<c10d::Backend> cpu_backend(const ProcessGroupPtr& pg);

// Launch an asynchronous all-reduce of `tensor` in place on `pg`; the caller waits.
WorkPtr start_allreduce(const ProcessGroupPtr& pg, at::Tensor& tensor, c10d::ReduceOp op);
// Launch an asynchronous sum reduce-scatter of the tensor form: rank r's range of `input`,
// at r x output.numel(), summed into `output`.
WorkPtr start_reduce_scatter(const ProcessGroupPtr& pg, at::Tensor& output, at::Tensor& input);

// The error a failed future holds, as a user reads it: a c10::Error's message without the
// C++ backtrace torch appends to what() (tens of "frame #" lines inside pycomm's messages).
std::string error_message(const c10::ivalue::Future& future);

// What a backend offers beyond c10d's API: an asynchronous sum all-reduce of several
// tensors as one buffer (in list order), each rank's elements multiplied by `scale` first,
// results written back in place (a DDP bucket reduced where its gradients are); the same
// buffer's sum reduce-scattered (a sharded optimizer's bucket, the tensors only read); and
// a sum all-reduce of one tensor. All carry `label`, which the backend compares across
// ranks (See Note [Collective identity] in shm/collectives.cpp). pycomm's shared-memory
// backend offers it (See Note [Pieces all-reduce] in shm/allreduce.cpp); the reducer asks
// for it here and knows no backend by name.
class BucketAllreduce {
 public:
  virtual ~BucketAllreduce() = default;
  virtual WorkPtr allreduce_pieces(std::vector<at::Tensor> tensors, double scale,
                                   const OpLabel& label) = 0;
  // With n elements in all over W ranks: `out` (n / W + n mod W elements) receives this
  // rank's range [r x n / W, (r + 1) x n / W) of the sum, then the sum of the last n mod W
  // elements, which every rank gets: the collectives reduce_scatter_tensor of the range
  // and all_reduce of the tail of a bucket pre-scaled.
  virtual WorkPtr reduce_scatter_pieces(std::vector<at::Tensor> tensors, double scale,
                                        at::Tensor out, const OpLabel& label) = 0;
  virtual WorkPtr allreduce_sum(at::Tensor tensor, const OpLabel& label) = 0;
};

// `backend` as a BucketAllreduce, or null when it does not offer one.
BucketAllreduce* bucket_allreduce(const c10::intrusive_ptr<c10d::Backend>& backend);

// What a backend spanning hosts offers: a sum all-reduce, and a sum reduce-scatter of the
// tensor form (rank r's range of `input` at r x output.numel() into `output`), whose
// cross-host legs carry `wire` with float32 sums, `residual` keeping their error feedback
// (pycomm's hierarchical backend: Note [Low-precision wire] in shm/wire_codec.h).
class WireCollectives {
 public:
  virtual ~WireCollectives() = default;
  virtual WorkPtr allreduce_wire(at::Tensor tensor, const Wire& wire,
                                 std::shared_ptr<WireResidual> residual) = 0;
  virtual WorkPtr reduce_scatter_wire(at::Tensor output, at::Tensor input, const Wire& wire,
                                      std::shared_ptr<WireResidual> residual) = 0;
  // The sum all-reduce of `tensors` as pieces of one buffer, each element scaled by `scale`
  // as it is read, written back into them: what allreduce_wire does to the buffer
  // pre-scaled, with the same bits, without the buffer.
  virtual WorkPtr allreduce_pieces_wire(std::vector<at::Tensor> tensors, double scale,
                                        const Wire& wire,
                                        std::shared_ptr<WireResidual> residual) = 0;
};

// `backend` as a WireCollectives, or null when it does not offer one.
WireCollectives* wire_collectives(const c10::intrusive_ptr<c10d::Backend>& backend);

}  // namespace pycomm::comm
