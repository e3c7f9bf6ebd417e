// The reducer's hot path: hooks, gradient copy into buckets, launch (see reducer.h).
#include "reducer/reducer.h"
#include "reducer/stream_copy.h"

#include <ATen/ScalarOps.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

namespace pycomm::reducer {

namespace {

// Note [Compiled autograd]
// Compiled autograd (torch._dynamo.config.compiled_autograd=True, and torch's
// optimize_ddp="python_reducer" mode, which needs it) replaces the autograd engine's run of
// backward with a graph it traces, into which only Python hooks can be traced. The
// reducer's hooks are C++: left out of that graph, the step's gradients would stay
// unreduced on every rank, silently. Compiled autograd asks every node and hook for its
// compiled form (compiled_args) before it runs anything; the reducer's hooks answer with
// this error, so such a backward raises before a single gradient is computed.
[[noreturn]] void refuse_compiled_autograd() {
  TORCH_CHECK(false,
              "pycomm DDP cannot reduce gradients under compiled autograd "
              "(torch._dynamo.config.compiled_autograd=True, or "
              "torch._dynamo.config.optimize_ddp=\"python_reducer\", which needs it): its "
              "reducer runs from the autograd engine's gradient hooks, which compiled autograd "
              "does not run, so the step would be left unreduced. Run this backward with "
              "compiled autograd off: torch.compile(ddp) still compiles forward and backward, "
              "split at pycomm's buckets (optimize_ddp=\"ddp_optimizer\", the default).");
}

// Fires on the first output node backward reaches: stamps the start of backward. The
// step itself begins at the first parameter hook, so a backward that reaches no
// parameter (torch.autograd.grad w.r.t. inputs) leaves the step armed, as torch does.
class BackwardStartHook final : public torch::autograd::FunctionPreHook {
 public:
  explicit BackwardStartHook(std::weak_ptr<Reducer*> reducer) : reducer_(std::move(reducer)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto reducer = reducer_.lock()) (*reducer)->on_backward_start();
    return grads;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    refuse_compiled_autograd();  // See Note [Compiled autograd]
  }

 private:
  std::weak_ptr<Reducer*> reducer_;
};

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 const std::vector<std::vector<size_t>>& assignment, comm::ProcessGroupPtr pg,
                 ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      pg_(std::move(pg)),
      options_(options),
      self_(std::make_shared<Reducer*>(this)),
      timeline_(options.record_timeline ? static_cast<size_t>(options.timeline_steps) : 0) {
  TORCH_CHECK_VALUE(pg_, "Reducer: process group is null");
  TORCH_CHECK_VALUE(!params_.empty(), "Reducer: no parameters that require grad");
  TORCH_CHECK_VALUE(names_.size() == params_.size(), "Reducer: ", names_.size(), " names for ",
                    params_.size(), " parameters");
  rank_ = pg_->getRank();
  div_factor_ = pg_->getSize();
  hook_ = std::make_unique<AllreduceSumHook>(pg_, options_.inline_collectives);
  marked_.assign(params_.size(), 0);
  ready_ns_.assign(params_.size(), -1);
  static_unused_.assign(params_.size(), 0);
  hook_counts_.assign(params_.size(), 0);
  expected_hooks_.assign(params_.size(), 1);
  local_used_ = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
  track_used_ = options_.find_unused_parameters || options_.static_graph;
  // Buckets are rebuilt from the observed ready order once, unless the graph is dynamic
  // (find_unused_parameters without static_graph), as torch does.
  record_order_ = !options_.find_unused_parameters || options_.static_graph;
  rebuild_buckets(assignment);
  install_hooks();
}

Reducer::~Reducer() {
  drain_launched();
  remove_hooks();
}

void Reducer::install_hooks() {
  for (size_t index = 0; index < params_.size(); ++index) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[index]);
    TORCH_CHECK(accumulator, "parameter ", names_[index], " has no gradient accumulator");
    std::weak_ptr<Reducer*> weak = self_;
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [weak, index](const torch::autograd::variable_list& outputs,
                          const torch::autograd::variable_list& /*inputs*/) {
              if (auto reducer = weak.lock()) (*reducer)->autograd_hook(index);
              return outputs;
            },
            [](torch::dynamo::autograd::CompiledNodeArgs& /*args*/) {
              refuse_compiled_autograd();  // See Note [Compiled autograd]
            })));
    accumulators_.push_back(std::move(accumulator));
  }
}

void Reducer::remove_hooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  accumulators_.clear();
  hook_keys_.clear();
}

void Reducer::rebuild_buckets(const std::vector<std::vector<size_t>>& assignment) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(state_ != State::kBackward, "cannot rebuild buckets during backward");
  auto sums = save_accumulated();
  buckets_ = build_buckets(params_, names_, assignment, options_.reduce_dtype, bucket_factory());
  locator_.assign(params_.size(), {0, 0});
  for (auto& bucket : buckets_) {
    for (size_t slot = 0; slot < bucket->params.size(); ++slot) {
      const size_t index = bucket->params[slot];
      locator_[index] = {bucket->index, slot};
      // gradient_as_bucket_view: an existing grad moves into its new slot.
      at::Tensor& grad = params_[index].mutable_grad();
      at::Tensor& view = bucket->views[slot];
      if (options_.gradient_as_bucket_view && grad.defined() &&
          grad.scalar_type() == view.scalar_type()) {
        view.copy_(grad);
        grad = view;
      }
    }
  }
  note_widened();
  for (auto& [index, sum] : sums) {
    grad_view(index).copy_(sum);
    accumulated_[index] = 1;
  }
  if (rebuild_pending_) {
    rebuild_pending_ = false;
    rebuilt_ = true;
  }
  reset_step();
}

at::Tensor Reducer::grad_view(size_t index) const {
  TORCH_CHECK_INDEX(index < params_.size(), "parameter index ", index, " out of range");
  const auto [bucket, slot] = locator_[index];
  return buckets_[bucket]->views[slot];
}

void Reducer::reset_step() {
  next_launch_ = 0;
  std::fill(marked_.begin(), marked_.end(), 0);
  std::fill(ready_ns_.begin(), ready_ns_.end(), -1);
  std::fill(hook_counts_.begin(), hook_counts_.end(), 0);
  finalize_queued_ = false;  // a backward that raised dropped its queued callback
  for (auto& bucket : buckets_) {
    bucket->pending = bucket->params.size();
    bucket->unused = 0;
    bucket->skipped = false;
    bucket->deferred.clear();
    bucket->future.reset();
    bucket->ready_ns = bucket->launch_ns = -1;
    bucket->done_ns.store(-1);
    bucket->ready_stamp = -1;
    bucket->done_stamp.store(-1);
  }
  used_future_.reset();
  backward_start_ns_ = -1;
  last_hooked_ = -1;
}

std::string Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string note = state_ == State::kBackward ? abandon_unfinished_step() : std::string();
  for (size_t i = 0; i < params_.size(); ++i) {
    // A RuntimeError, as torch's (which raises one a forward later, when the step this
    // parameter left unfinished is found): code written for torch's DDP catches it.
    TORCH_CHECK(params_[i].requires_grad(), "pycomm DDP (rank ", rank_, "): parameter ",
                names_[i], " no longer requires grad: requires_grad changed after "
                "DistributedDataParallel was constructed; wrap the module again");
  }
  reset_step();
  unused_.clear();
  if (options_.static_graph && !track_used_) {
    // This rank's own unused set, learned in the first step (torch's unused_parameters_).
    for (size_t i = 0; i < params_.size(); ++i) {
      if (expected_hooks_[i] == 0) unused_.push_back(i);
    }
  } else if (options_.find_unused_parameters && !options_.static_graph) {
    find_unused(outputs);
  }
  if (record_order_ && !rebuilt_) note_groups(outputs);
  std::weak_ptr<Reducer*> weak = self_;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) {
      out.grad_fn()->add_pre_hook(std::make_unique<BackwardStartHook>(weak));
    }
  }
  state_ = State::kPrepared;
  return note;
}

std::string Reducer::prepare_no_sync() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string note = state_ == State::kBackward ? abandon_unfinished_step() : std::string();
  state_ = State::kIdle;
  return note;
}

// The finalize callback goes on the graph task that runs the module's outputs' backward,
// queued from there (on_backward_start) or, when backward reaches a parameter without
// passing an output, at the first parameter hook. Not at the first hook in general: with
// torch.utils.checkpoint(use_reentrant=True) the first hooks fire inside a nested
// backward, whose task ends (and would run finalize) before the other segments' run.
void Reducer::queue_finalize() {
  if (finalize_queued_) return;
  finalize_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([weak = std::weak_ptr(self_)] {
    if (auto reducer = weak.lock()) (*reducer)->finalize_backward();
  });
}

void Reducer::on_backward_start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::kPrepared) return;
  if (backward_start_ns_ < 0) backward_start_ns_ = now_ns();
  queue_finalize();
}

void Reducer::begin_backward_locked() {
  state_ = State::kBackward;
  if (backward_start_ns_ < 0) backward_start_ns_ = now_ns();
  const c10::Device device = buckets_.front()->buffer.device();
  stamps_ = options_.record_timeline && !device.is_cpu()
                ? std::make_shared<DeviceStamps>(device) : nullptr;
  scale_value_ = 1.0 / static_cast<double>(div_factor_);
  scale_ = at::native::wrapped_scalar_tensor(scale_value_);
  queue_finalize();
  for (size_t index : unused_) ++buckets_[locator_[index].first]->unused;
  for (size_t index : unused_) mark_ready(index, /*used=*/false);
}

void Reducer::autograd_hook(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (track_used_) local_used_.data_ptr<int32_t>()[index] = 1;
  if (widened_[index]) accumulate_main_grad(index);
  if (state_ == State::kIdle) return;  // no_sync, or a forward that bypassed the wrapper
  TORCH_CHECK(state_ != State::kReduced, "pycomm DDP (rank ", rank_, "): parameter ",
              names_[index], " got a gradient after this step was already reduced: backward "
              "ran twice without a forward through the DistributedDataParallel wrapper");
  if (state_ == State::kPrepared) begin_backward_locked();
  last_hooked_ = static_cast<int64_t>(index);
  if (options_.static_graph && static_hook_pending(index)) return;
  // torch raises a RuntimeError at the same point ("Expected to mark a variable ready only
  // once"); a hook that fires twice without static_graph has no count to wait for.
  TORCH_CHECK(!marked_[index], "pycomm DDP (rank ", rank_, "): parameter ", names_[index],
              " was marked ready twice in one backward: it received gradients from more "
              "than one reentrant backward (e.g. a layer run in several "
              "torch.utils.checkpoint(use_reentrant=True) segments), or it was used outside "
              "the module's outputs, or find_unused_parameters=True marked it unused because "
              "a reentrant checkpoint hides it from the graph. Pass static_graph=True when the "
              "graph is the same every step, or use use_reentrant=False.");
  mark_ready(index, /*used=*/true);
}

void Reducer::mark_ready(size_t index, bool used) {
  marked_[index] = 1;
  const auto [bucket_index, slot] = locator_[index];
  Bucket& bucket = *buckets_[bucket_index];
  copy_into_bucket(bucket, slot);
  if (options_.record_timeline && used && ready_ns_[index] < 0) ready_ns_[index] = now_ns();
  if (record_order_) order_.push_back(index);
  if (--bucket.pending == 0) {
    if (options_.batched_grad_copy) flush_batched(bucket);
    bucket.ready_ns = now_ns();
    if (stamps_) bucket.ready_stamp = stamps_->stamp();
    if (!gate_) launch_ready_buckets();
  }
}

// Mirrors torch's reducer numerics exactly (mark_variable_ready_dense): averaging is
// folded into the copy (mul_out by 1/world) unless a hook averages; a grad that already
// is the bucket view is divided in place.
void Reducer::copy_into_bucket(Bucket& bucket, size_t slot) {
  const size_t index = bucket.params[slot];
  at::Tensor& view = bucket.views[slot];
  at::Tensor& grad = params_[index].mutable_grad();
  const bool divide = divides_in_copy();
  if (finish_accumulated(index, view, divide)) return;
  if (!grad.defined()) {
    view.zero_();
    return;
  }
  TORCH_CHECK_VALUE(!grad.is_sparse(), "parameter ", names_[index], " has a sparse gradient: "
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
    if (divide) view.div_(div_factor_);
    return;
  }
  if (view.scalar_type() != grad.scalar_type()) {
    // reduce_dtype: widen first so the scaling rounds in the wide type.
    view.copy_(grad);
    if (divide) view.mul_(scale_);
    return;
  }
  if (!divide) {
    if (!streams(grad) || !stream_copy(view, grad, std::nullopt)) view.copy_(grad);
  } else if (grad.requires_grad()) {
    view.copy_(at::mul(grad, scale_));  // create_graph=True: keep grad's graph out
  } else if (!streams(grad) || !stream_copy(view, grad, scale_value_)) {
    at::mul_out(view, grad, scale_);  // See Note [Streaming copies] in stream_copy.cpp
  }
  if (options_.gradient_as_bucket_view) grad = view;
}

// Note [Bucket order]
// Every rank launches the bucket collectives strictly in bucket index order: a bucket
// whose gradients are all in waits until every lower-index bucket has launched (as torch
// does). Bucket assignment is identical on all ranks (built from the same parameter list,
// and rebuilt from rank 0's broadcast ready order), so the i-th collective of a step is
// the same bucket everywhere, whatever order gradients become ready in on each rank.
void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->pending == 0) {
    launch(*buckets_[next_launch_++]);
  }
  if (next_launch_ == buckets_.size() && track_used_) {
    // Usage is summed across ranks after the last bucket (see Note [Bucket order]).
    // On an accelerator: a pinned, non-blocking copy, so backward never waits for it.
    const c10::Device device = buckets_.front()->buffer.device();
    at::Tensor used = local_used_.clone();
    if (!device.is_cpu()) used = used.pin_memory().to(device, /*non_blocking=*/true);
    used_future_ = comm::start_allreduce(pg_, used, c10d::ReduceOp::SUM)->getFuture();
  }
}

bool Reducer::skips(const Bucket& bucket) const {
  return options_.skip_all_reduce_unused && bucket.unused == bucket.params.size();
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
    if (options_.gradient_as_bucket_view) {
      for (size_t slot : bucket.deferred) {
        at::Tensor& grad = params_[bucket.params[slot]].mutable_grad();
        if (grad.scalar_type() == bucket.views[slot].scalar_type()) grad = bucket.views[slot];
      }
    }
    bucket.deferred.clear();
  }
  if (hook_->reducer_divides() && !gate_) bucket.buffer.div_(div_factor_);  // gate: it divides
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
  if (skips(bucket)) {  // see ReducerOptions::skip_all_reduce_unused: no communication
    bucket.skipped = true;
    bucket.launch_ns = bucket.ready_ns;
    bucket.done_ns.store(bucket.ready_ns);
    return;
  }
  for (auto& callback : pre_launch_) callback(bucket);
  bucket.launch_ns = now_ns();
  FuturePtr future = hook_->run(bucket, buckets_.size(), params_);
  Bucket* target = &bucket;
  auto* callbacks = &post_done_;
  bucket.future = future->then(
      [target, callbacks, stamps = stamps_](c10::ivalue::Future& parent) -> c10::IValue {
        at::Tensor out = result_tensor(parent.value());
        target->done_ns.store(now_ns());
        if (stamps) target->done_stamp.store(stamps->stamp());
        if (!out.is_same(target->buffer)) target->buffer.copy_(out.view(target->buffer.sizes()));
        for (auto& callback : *callbacks) callback(*target);
        return target->buffer;
      },
      c10::TensorType::get());
}

void Reducer::set_comm_hook(std::unique_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!python_hook_, "a communication hook is already registered; register it once");
  TORCH_CHECK(step_ == 0, "register the communication hook before the first backward");
  python_hook_ = dynamic_cast<PythonCommHook*>(hook.get()) != nullptr;
  hook_ = std::move(hook);
}

void Reducer::add_pre_launch(BucketCallback callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  pre_launch_.push_back(std::move(callback));
}

void Reducer::add_post_done(BucketCallback callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  post_done_.push_back(std::move(callback));
}

void Reducer::set_divide_factor(int64_t factor) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK_VALUE(factor > 0, "divide factor must be positive, got ", factor);
  div_factor_ = factor;
}

}  // namespace pycomm::reducer
