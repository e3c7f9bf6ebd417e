// The reducer's hot path, part 1 (see reducer.h): backward starts, each gradient hook copies
// its gradient (pre-scaled) into its bucket slot, and a complete bucket's collective is
// launched in bucket order. Part 2, waiting for the collectives and writing param.grad, is
// finalize.cpp.
#include <ATen/ScalarOps.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/utils/pybind.h>

#include "comm/thread_state.h"
#include "reducer/reducer.h"
#include "reducer/stream_copy.h"

namespace pycomm::reducer {

// The finalize callback goes on the graph task that runs the module's outputs' backward,
// queued from there (on_backward_start) or, when backward reaches a parameter without
// passing an output, at the first parameter hook. Not at the first hook in general: with
// torch.utils.checkpoint(use_reentrant=True) the first hooks fire inside a nested
// backward, whose task ends (and would run finalize) before the other segments' run.
void Reducer::queue_finalize() {
  if (progress_.finalize_queued || manual_finalization_)
    return;  // See Note [Manual backward finalization]
  progress_.finalize_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback(
      [weak = std::weak_ptr(grad_hooks_.self)] {
        if (auto reducer = weak.lock()) (*reducer)->finalize_backward();
      });
}

void Reducer::on_backward_start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (progress_.state != State::kPrepared) return;
  timing_.start_backward();
  queue_finalize();
}

void Reducer::begin_backward_locked() {
  progress_.state = State::kBackward;
  timing_.begin_step(layout_.device());
  averaging_.scale_value = 1.0 / static_cast<double>(averaging_.divisor);
  averaging_.scale = at::native::wrapped_scalar_tensor(averaging_.scale_value);
  // See Note [Bucket paths] in bucket.h: the plan's, unless two of this step's gradients
  // share memory (Note [Gradients reduced in place])
  const bool shared = plan_.any_in_place && grads_share_memory();
  for (auto& bucket : layout_.buckets()) {
    const BucketPath planned = plan_.paths[bucket->index];
    bucket->path = shared ? through_buffer(planned) : planned;
  }
  queue_finalize();
  for (size_t index : usage_.unused()) ++layout_.bucket_of(index).unused;
  for (size_t index : usage_.unused()) mark_ready(index, /*used=*/false);
}

void Reducer::autograd_hook(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  usage_.note_hook(index);
  if (main_grads_.widened(index)) {
    main_grads_.accumulate(index, params_[index], layout_.view(index), names_[index]);
  }
  if (progress_.state == State::kIdle) return;  // no_sync, or a forward that bypassed the wrapper
  TORCH_CHECK(progress_.state != State::kReduced, "pycomm DDP (rank ", rank(), "): parameter ",
              names_[index],
              " got a gradient after this step was already reduced: backward "
              "ran twice without a forward through the DistributedDataParallel wrapper");
  if (progress_.state == State::kPrepared) begin_backward_locked();
  progress_.last_hooked = static_cast<int64_t>(index);
  if (options_.static_graph) {  // See Note [Static graph hook counts]
    timing_.param_ready(index, /*last=*/true);
    const Usage::Hook hook = usage_.count_hook(index, names_[index]);
    if (hook.first && usage_.counting_hooks()) recorder_.note_ready(index);
    if (hook.pending) return;
  }
  // torch raises a RuntimeError at the same point ("Expected to mark a variable ready only
  // once"); a hook that fires twice without static_graph has no count to wait for.
  TORCH_CHECK(!progress_.marked[index], "pycomm DDP (rank ", rank(), "): parameter ", names_[index],
              " was marked ready twice in one backward: it received gradients from more "
              "than one reentrant backward (e.g. a layer run in several "
              "torch.utils.checkpoint(use_reentrant=True) segments), or it was used outside "
              "the module's outputs, or find_unused_parameters=True marked it unused because "
              "a reentrant checkpoint hides it from the graph. Pass static_graph=True when the "
              "graph is the same every step, or use use_reentrant=False.");
  mark_ready(index, /*used=*/true);
}

void Reducer::mark_ready(size_t index, bool used) {
  progress_.marked[index] = 1;
  Bucket& bucket = layout_.bucket_of(index);
  const size_t slot = layout_.slot_of(index);
  if (!keeps_in_place(bucket, slot)) copy_into_bucket(bucket, slot);
  if (used) timing_.param_ready(index);
  recorder_.note_ready(index);
  if (--bucket.pending == 0) {
    if (options_.batched_grad_copy) flush_batched(bucket);
    timing_.bucket_ready(bucket);
    if (!ext_.gate) launch_ready_buckets();
  }
}

// Mirrors torch's reducer numerics exactly (mark_variable_ready_dense): averaging is
// folded into the copy (mul_out by 1/world) unless a hook averages; a grad that already
// is the bucket view is divided in place.
// Note [Released gradients]
// Where the plan releases (Plan::releases: pycomm.ZeroRedundancyOptimizer attached in
// Sharding::kReleased, whose hook reads each bucket's reduced shard out of it and then
// frees the bucket's storage), gradient memory follows the step instead of staying whole: a bucket
// whose storage was freed gets it back (the same storage, resized, so its views stay valid) when
// the first gradient of a step is copied into it; a parameter's gradient is dropped once
// it is copied into its bucket (param.grad is None again); finalize leaves param.grad
// alone. At any moment a rank holds the gradients not yet copied, the buckets filling or
// in flight, and its shards. Under no_sync nothing is copied, so param.grad accumulates as
// usual; batched_grad_copy drops the gradients at the bucket's one copy. A bucket reduced
// in place (Note [Gradients reduced in place]: the optimizer's reduce-scatter straight from
// param.grad) is never filled: its gradients stay in param.grad until its collective is
// done, then are dropped (release_in_place), and its storage stays freed.
void Reducer::copy_into_bucket(Bucket& bucket, size_t slot) {
  const size_t index = bucket.params[slot];
  at::Tensor& view = bucket.views[slot];
  at::Tensor& grad = params_[index].mutable_grad();
  const bool divide = divides_in_copy();
  const bool release = releases(bucket.path);
  if (release || lends_buffer(bucket)) ensure_storage(bucket.buffer);
  if (main_grads_.take(index)) {  // the view holds the local sum (Note [main_grad accumulation])
    if (divide) view.mul_(averaging_.scale);
    return;
  }
  if (!grad.defined()) {
    view.zero_();
    return;
  }
  TORCH_CHECK_VALUE(!grad.is_sparse(), "parameter ", names_[index],
                    " has a sparse gradient: "
                    "pycomm DDP reduces dense gradients only (use sparse=False)");
  if (options_.batched_grad_copy && !grad.is_alias_of(view)) {
    // See ReducerOptions::batched_grad_copy. A grad that requires grad (create_graph)
    // is copied now, unscaled too, so the bucket's one division covers it exactly once.
    if (grad.requires_grad()) {
      view.copy_(grad.detach());
    } else {
      bucket.deferred.push_back(slot);
    }
    return;
  }
  if (grad.is_alias_of(view)) {
    if (divide) view.div_(averaging_.divisor);
    return;
  }
  if (view.scalar_type() != grad.scalar_type()) {
    // grad_reduce_dtype: widen first so the scaling rounds in the wide type.
    view.copy_(grad);
    if (divide) view.mul_(averaging_.scale);
    return;
  }
  if (!divide) {
    if (!streams(grad) || !stream_copy(view, grad, std::nullopt)) view.copy_(grad);
  } else if (grad.requires_grad()) {
    view.copy_(at::mul(grad, averaging_.scale));  // create_graph=True: keep grad's graph out
  } else if (!streams(grad) || !stream_copy(view, grad, averaging_.scale_value)) {
    at::mul_out(view, grad, averaging_.scale);  // See Note [Streaming copies] in stream_copy.cpp
  }
  if (release) {
    grad = at::Tensor();  // See Note [Released gradients]
  } else if (options_.gradient_as_bucket_view) {
    grad = view;
  }
}

// A bucket reduced where its gradients are, where the plan releases (Plan::releases): its
// parameters' gradients are dropped once its collective is done (Note [Released
// gradients]). Under the GIL: Python code (a user's hook on another parameter, say) may
// read param.grad meanwhile, and the GIL orders that read and this write.
void Reducer::release_in_place(Bucket& bucket, const std::vector<at::Tensor>& params) {
  pybind11::gil_scoped_acquire gil;
  for (const auto& param : params) param.mutable_grad().reset();
  bucket.grads.clear();
}

// Note [Bucket order]
// Every rank launches the bucket collectives strictly in bucket index order: a bucket
// whose gradients are all in waits until every lower-index bucket has launched (as torch
// does). Bucket assignment is identical on all ranks (built from the same parameter list,
// and rebuilt from rank 0's broadcast ready order), so the i-th collective of a step is
// the same bucket everywhere, whatever order gradients become ready in on each rank.
void Reducer::launch_ready_buckets() {
  // See Note [No Python object in a collective's thread state] in comm/thread_state.h
  const comm::WithoutPythonObjects no_python_objects;
  while (progress_.next_launch < layout_.size() && layout_[progress_.next_launch].pending == 0) {
    launch(layout_[progress_.next_launch++]);
  }
  if (progress_.next_launch == layout_.size() && usage_.tracking()) {
    usage_.start_allreduce(pg_, layout_.device());  // See Note [Parameter usage]
  }
}

bool Reducer::skips(const Bucket& bucket) const {
  return options_.skip_all_reduce_unused_params && bucket.unused == bucket.params.size();
}

// batched_grad_copy: the bucket's deferred copies in one _foreach_copy_, then one division
// of the whole bucket (zeroed slots of undefined grads divide to zero).
void Reducer::flush_batched(Bucket& bucket) {
  if (!bucket.deferred.empty()) {
    std::vector<at::Tensor> views;
    std::vector<at::Tensor> grads;
    views.reserve(bucket.deferred.size());
    grads.reserve(bucket.deferred.size());
    for (size_t slot : bucket.deferred) {
      views.push_back(bucket.views[slot]);
      grads.push_back(params_[bucket.params[slot]].grad());
    }
    at::_foreach_copy_(views, grads);
    if (releases(bucket.path)) {
      for (size_t slot : bucket.deferred) params_[bucket.params[slot]].mutable_grad().reset();
    } else if (options_.gradient_as_bucket_view) {
      for (size_t slot : bucket.deferred) {
        at::Tensor& grad = params_[bucket.params[slot]].mutable_grad();
        if (grad.scalar_type() == bucket.views[slot].scalar_type()) grad = bucket.views[slot];
      }
    }
    bucket.deferred.clear();
  }
  if (plan_.reducer_averages && !ext_.gate)
    bucket.buffer.div_(averaging_.divisor);  // gate: it divides
}

// Note [Inline collectives]
// On a machine whose cores are all busy with the ranks' compute threads (2 local ranks
// on 2 cores), a communication thread can only run by taking a core from backward, and
// the shared-memory all-reduce advances only while both ranks' communication threads are
// on a core at once: each rendezvous waits for the scheduler, and the bucket finishes
// late, after backward, in the exposed tail. Run inline, the bucket's collective happens
// on the backward thread itself, which is on a core on every rank at about the same
// point of backward: no thread hand-off, no rendezvous across descheduled threads, the
// same bytes moved. The wait lets the shared-memory backend run the queued operation on
// this thread (See Note [Waiting helps] in shm/work.h).
//
//   async:   backward [b0 grads][b1 grads][b2 grads]  wait ......... finalize
//            comm thread          [ar b0 ~~~ stalls ~~~ ar b1 ~~~~~~ ar b2]
//   inline:  backward [b0 grads][ar b0][b1 grads][ar b1][b2 grads][ar b2] finalize
void Reducer::launch(Bucket& bucket) {
  if (skips(bucket)) {  // see ReducerOptions::skip_all_reduce_unused_params: no communication
    bucket.skipped = true;
    bucket.launch_ns = bucket.ready_ns;
    bucket.done_ns.store(bucket.ready_ns);
    return;
  }
  if (!in_place(bucket.path) && lends_buffer(bucket)) ensure_storage(bucket.buffer);
  for (auto& callback : ext_.pre_launch) callback(bucket);
  bucket.launch_ns = now_ns();
  const comm::OpLabel label{static_cast<int64_t>(bucket.index), progress_.forwards, progress_.step};
  if (!progress_.labelled && step_label_elements() > 0) {  // See Note [Step labels over the group]
    progress_.labelled = true;
    ext_.hook->begin_step(label);
  }
  FuturePtr future = launches_in_place(bucket)
                         ? ext_.hook->run_in_place(bucket, layout_.size(), params_, bucket.grads,
                                                   averaging_.scale_value, label)
                         : ext_.hook->run(bucket, layout_.size(), params_, label);
  Bucket* target = &bucket;
  auto* callbacks = &ext_.post_done;
  // Reduced where they are, a sharded optimizer's gradients go once its hook kept its
  // range (Note [Released gradients]).
  std::vector<at::Tensor> released;
  if (bucket.path == BucketPath::kReleasedInPlace) {
    for (size_t index : bucket.params) released.push_back(params_[index]);
  }
  bucket.future = future->then(
      [target, callbacks, stamps = timing_.stamps(),
       released = std::move(released)](c10::ivalue::Future& parent) -> c10::IValue {
        const c10::IValue& value = parent.value();  // rethrows the collective's error
        target->done_ns.store(now_ns());
        if (stamps) target->done_stamp.store(stamps->stamp());
        if (!in_place(target->path)) {
          at::Tensor out = result_tensor(value);
          TORCH_CHECK(out.numel() == target->buffer.numel(),
                      "the bucket's future holds a tensor of ", out.numel(),
                      " elements; the bucket has ", target->buffer.numel(),
                      " (a communication hook must return bucket.buffer() reduced, or a tensor of "
                      "its size)");
          if (!out.is_same(target->buffer)) target->buffer.copy_(out.view(target->buffer.sizes()));
        }
        for (auto& callback : *callbacks) callback(*target);
        if (!released.empty()) release_in_place(*target, released);
        return target->buffer;
      },
      c10::TensorType::get());
}

}  // namespace pycomm::reducer
