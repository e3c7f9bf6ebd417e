// Buckets reduced where their gradients are, with no copy into the bucket and none back.
#include "reducer/reducer.h"
#include "shm/tensor_args.h"

namespace pycomm::reducer {

// Note [Gradients reduced in place]
// torch's DDP moves every gradient through its bucket: its hook copies it in, scaled by
// 1/world; the bucket is all-reduced; finalize copies the result back into param.grad.
// Each pass reads and writes every gradient byte once, so with the all-reduce's own pass
// a step moves each byte through memory three times, and on a CPU that is most of the
// communication's cost (benchmarks/results/ddp_floor_cpu.md). Over pycomm's
// shared-memory group the bucket is not needed: the all-reduce of pieces (Note [Pieces
// all-reduce] in shm/allreduce.cpp) reads each rank's gradients straight from param.grad,
// multiplying by 1/world as it reads, and writes the sums straight back, with the same
// arithmetic in the same order, so param.grad ends with the bits the bucket would have
// given it. The hooks then only count, and finalize has nothing to copy. Across hosts, over
// pycomm's hierarchical group, each block of the bucket is reduce-scattered within the host
// straight from the gradients the same way, on any wire (Note [Hierarchical all-reduce of
// pieces] in shm/hier_allreduce.cpp).
//
// It applies to the default all-reduce on a "pycomm" group (the hook's reduces_in_place)
// and on any group of one rank (Note [One rank reduces nothing] in comm_hook.cpp),
// and to pycomm.ZeroRedundancyOptimizer's reduce-scatter once its shards are final (its
// hook's in-place form, ShardHook in shard_hook.h, Note [Pieces reduce-scatter] in
// shm/collectives.cpp: the gradients are only read, the rank's range lands in the optimizer's
// shard), when nothing else needs the bucket's memory: not with gradient_as_bucket_view (param.grad
// is the bucket there), another comm hook, a bucket callback that reads the buffer, a launch
// gate, batched_grad_copy, find_unused_parameters or static_graph (an unused parameter's
// slot is zeros that param.grad does not have), grad_reduce_dtype (the wide copy is the bucket),
// nor with DDPConfig(in_place_reduction=False). Then, per step and bucket, each gradient
// must be a defined, dense tensor on the bucket's device, of its dtype (float32 or float64
// on CPU for the shared-memory pieces, float32 alone across hosts on a low-precision wire;
// any device and floating dtype alone) without autograd history (create_graph), laid out in memory
// as its bucket slot is (the same strides): then its bytes are in the order of the slot's, which is
// what lets ranks whose bucket went through the buffer and ranks whose did not add the same
// elements together. The first hook whose gradient is not so sends its bucket back to the buffer
// for the step: the gradients left in place so far are copied in then, as their hooks would have
// (nothing else wrote them meanwhile: autograd writes a parameter's gradient only before
// its hook). The launch checks them all again (a gradient replaced after its hook).
//
// That last point fails when two parameters' gradients share memory (a user's
// q.grad = p.grad): q's accumulation writes into p's gradient after p's hook, into a
// bucket that may be reducing it in place, and torch's result there is defined by the
// copy p's hook took. Gradients that autograd creates never share memory with another
// parameter's, so only gradients already there when backward starts can: when any two
// of them overlap, the whole step goes through the buffers (checked once per step).
//
// Once a bucket launches, its collective writes into those param.grad tensors while
// backward goes on, as torch's reducer writes into the bucket views of
// gradient_as_bucket_view: autograd does not touch them again in this backward (a second
// gradient for a parameter is an error there), but a later hook of the user's on the same
// parameter would see the reduction under way, not the local gradient.
//
// What depends on the options, the hook and the extension points alone is read once per
// plan (Note [The reducer's plan]); a step checks only its gradients.
bool Reducer::in_place_allowed() const {
  const ReducerOptions& o = options_;
  return o.in_place_reduction && ext_.hook->reduces_in_place() && !ext_.gate &&
         ext_.pre_launch.empty() && !ext_.post_done_reads_buffer && !o.gradient_as_bucket_view &&
         !o.batched_grad_copy && !o.find_unused_parameters && !o.static_graph &&
         !o.grad_reduce_dtype.has_value() && !o.skip_all_reduce_unused_params;
}

bool Reducer::grads_share_memory() const {
  std::vector<at::Tensor> grads;
  grads.reserve(params_.size());
  for (const auto& param : params_) {
    if (param.grad().defined()) grads.push_back(param.grad());
  }
  return shm::any_overlap(grads);
}

// At parameter `slot`'s hook: whether its gradient stays where it is (the bucket is still
// reduced in place and this gradient qualifies); if not, the bucket leaves the in-place
// path for this step and the caller copies this gradient in.
bool Reducer::keeps_in_place(Bucket& bucket, size_t slot) {
  if (!in_place(bucket.path)) return false;
  if (qualifies_in_place(bucket, slot)) return true;
  leave_in_place(bucket, slot);
  return false;
}

bool Reducer::qualifies_in_place(const Bucket& bucket, size_t slot) const {
  const at::Tensor& grad = params_[bucket.params[slot]].grad();
  const at::Tensor& view = bucket.views[slot];
  return grad.defined() && grad.device() == view.device() && grad.layout() == at::kStrided &&
         grad.scalar_type() == view.scalar_type() && grad.is_non_overlapping_and_dense() &&
         grad.strides() == view.strides() && !grad.requires_grad() && !grad.is_neg() &&
         !grad.is_conj() && !grad.is_alias_of(view);
}

// The bucket goes through its buffer this step: every gradient already marked ready and
// left in place (all but `except`, which the caller copies) is copied in now.
void Reducer::leave_in_place(Bucket& bucket, size_t except) {
  bucket.path = through_buffer(bucket.path);
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    if (slot != except && progress_.marked[bucket.params[slot]]) copy_into_bucket(bucket, slot);
  }
}

// At launch: the bucket's gradients, in slot order, into bucket.grads, each checked again;
// one replaced since its hook, or two that share memory, send the bucket back to its buffer.
bool Reducer::launches_in_place(Bucket& bucket) {
  if (!in_place(bucket.path)) return false;
  bucket.grads.clear();
  bucket.grads.reserve(bucket.params.size());
  bool all = true;
  for (size_t slot = 0; slot < bucket.params.size() && all; ++slot) {
    all = qualifies_in_place(bucket, slot);
    bucket.grads.push_back(params_[bucket.params[slot]].grad());
  }
  if (all && !shm::any_overlap(bucket.grads)) return true;
  bucket.grads.clear();
  leave_in_place(bucket, bucket.params.size());
  return false;
}

}  // namespace pycomm::reducer
