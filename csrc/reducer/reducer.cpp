// The reducer's set-up: construction, hooks, bucket (re)building, the arming of each step
// (prepare_*), its settings and the queries of its parts. The hot path is launch.cpp
// (hook -> bucket -> launch), then finalize.cpp (wait -> grads); see reducer.h.
#include "reducer/reducer.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>

#include "shm/collectives.h"

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

const comm::ProcessGroupPtr& checked(const comm::ProcessGroupPtr& pg) {
  TORCH_CHECK_VALUE(pg, "Reducer: process group is null");
  return pg;
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 const std::vector<std::vector<size_t>>& assignment, comm::ProcessGroupPtr pg,
                 ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      pg_(checked(pg)),
      options_(options),
      averaging_{pg_->getSize()},
      usage_(params_.size(), pg_->getRank(), options.find_unused_parameters, options.static_graph),
      recorder_(params_.size(), options.find_unused_parameters, options.static_graph),
      timing_(params_.size(), options.record_timeline,
              static_cast<size_t>(std::max<int64_t>(options.timeline_steps, 0))) {
  grad_hooks_.self = std::make_shared<Reducer*>(this);
  progress_.marked.assign(params_.size(), 0);
  TORCH_CHECK_VALUE(!params_.empty(), "Reducer: no parameters that require grad");
  TORCH_CHECK_VALUE(names_.size() == params_.size(), "Reducer: ", names_.size(), " names for ",
                    params_.size(), " parameters");
  ext_.hook = std::make_unique<AllreduceSumHook>(pg_, options_.inline_collectives,
                                                 options_.wire_format);
  rebuild_buckets(assignment);
  // Buckets the wire in effect cannot carry are refused now, naming a parameter, rather than
  // at their first backward (See Note [The wire as a value] in comm/wire.h); a re-cut keeps
  // each parameter's dtype.
  for (const auto& bucket : layout_.buckets()) {
    const size_t first = bucket->params.front();
    const auto dtype = bucket->buffer.scalar_type();
    plan_.wire->check_carries(
        dtype, "parameter '" + names_[first] + "'" +
                   (params_[first].scalar_type() == dtype ? " is " : " is reduced in ") +
                   shm::dtype_name(dtype) + " (bucket " + std::to_string(bucket->index) + ")");
  }
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
    std::weak_ptr<Reducer*> weak = grad_hooks_.self;
    grad_hooks_.keys.push_back(
        accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [weak, index](const torch::autograd::variable_list& outputs,
                          const torch::autograd::variable_list& /*inputs*/) {
              if (auto reducer = weak.lock()) (*reducer)->autograd_hook(index);
              return outputs;
            },
            [](torch::dynamo::autograd::CompiledNodeArgs& /*args*/) {
              refuse_compiled_autograd();  // See Note [Compiled autograd]
            })));
    grad_hooks_.accumulators.push_back(std::move(accumulator));
  }
}

void Reducer::remove_hooks() {
  for (size_t i = 0; i < grad_hooks_.accumulators.size(); ++i)
    grad_hooks_.accumulators[i]->del_post_hook(grad_hooks_.keys[i]);
  grad_hooks_.accumulators.clear();
  grad_hooks_.keys.clear();
}

void Reducer::rebuild_buckets(const std::vector<std::vector<size_t>>& assignment) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(progress_.state != State::kBackward, "cannot rebuild buckets during backward");
  const auto sums = main_grads_.save(layout_);
  layout_.build(params_, names_, assignment, options_.grad_reduce_dtype,
                options_.gradient_as_bucket_view);
  main_grads_.reset(layout_, params_);
  main_grads_.restore(layout_, sums);
  recorder_.note_rebuilt();
  reset_step();
  replan();
}

at::Tensor Reducer::grad_view(size_t index) const {
  TORCH_CHECK_INDEX(index < params_.size(), "parameter index ", index, " out of range");
  return layout_.view(index);
}

void Reducer::reset_step() {
  progress_.next_launch = 0;
  std::fill(progress_.marked.begin(), progress_.marked.end(), 0);
  progress_.finalize_queued = false;  // a backward that raised dropped its queued callback
  layout_.reset_step();
  usage_.reset_step();
  timing_.reset_step();
  progress_.last_hooked = -1;
  progress_.labelled = false;
}

void Reducer::refuse_unfinalized() const {
  TORCH_CHECK(!awaits_manual_finalize(), "pycomm DDP (rank ", rank(),
              "): the previous synchronized backward was not finalized: with "
              "require_manual_backward_finalization, call finalize_backward() after each "
              "synchronized backward, before the next forward (See Note [Manual backward "
              "finalization])");
}

std::string Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  refuse_unfinalized();
  std::string note = progress_.state == State::kBackward ? abandon_unfinished_step()
                                                         : std::string();
  reset_step();
  usage_.plan(outputs, grad_hooks_.accumulators);
  // A parameter frozen after construction is never reached by the backward. Where this
  // step marks it unused it trains on: the walk of find_unused_parameters finds it, as
  // torch's does (static_graph's learned set holds it only if it was unused in the first
  // step). Otherwise its bucket would never be complete: a RuntimeError, as torch's (which
  // raises one a forward later, when the step it left unfinished is found); code written
  // for torch's DDP catches it.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad()) continue;
    // static_graph's first step learns its unused set at its end (Note [Static graph hook
    // counts]): with find_unused_parameters a frozen parameter is one of them
    if (options_.find_unused_parameters && usage_.counting_hooks()) continue;
    const std::vector<size_t>& unused = usage_.unused();
    TORCH_CHECK(std::find(unused.begin(), unused.end(), i) != unused.end(), "pycomm DDP (rank ",
                rank(), "): parameter ", names_[i],
                " no longer requires grad: requires_grad changed after "
                "DistributedDataParallel was constructed; wrap the module again, or pass "
                "find_unused_parameters=True without static_graph (a frozen parameter is "
                "then an unused one)");
  }
  ++progress_.forwards;
  recorder_.plan(outputs, grad_hooks_.accumulators);
  std::weak_ptr<Reducer*> weak = grad_hooks_.self;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) {
      out.grad_fn()->add_pre_hook(std::make_unique<BackwardStartHook>(weak));
    }
  }
  progress_.state = State::kPrepared;
  return note;
}

std::string Reducer::prepare_no_sync() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (awaits_manual_finalize()) {
    // An evaluation forward (no grad) may run before the caller finalizes; a no_sync
    // micro-step may not (See Note [Manual backward finalization]).
    if (!c10::GradMode::is_enabled()) return std::string();
    refuse_unfinalized();
  }
  std::string note = progress_.state == State::kBackward ? abandon_unfinished_step()
                                                         : std::string();
  progress_.state = State::kIdle;
  if (c10::GradMode::is_enabled())
    ++progress_.forwards;  // a no_sync micro-step (not an evaluation)
  return note;
}

void Reducer::set_comm_hook(std::unique_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(plan_.wire.has_value(),
              plan_.sharding == Sharding::kReleased
                  ? "a ZeroRedundancyOptimizer with release_gradients=True reduces this DDP's "
                    "buckets with its own hook; a communication hook cannot be added"
                  : "a communication hook is already registered; register it once");
  TORCH_CHECK(progress_.step == 0, "register the communication hook before the first backward");
  ext_.hook = std::move(hook);
  replan();
}

void Reducer::attach_sharding(Sharding sharding, std::unique_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(progress_.state != State::kBackward,
              "attach a sharder between steps, not during a backward");
  TORCH_CHECK((sharding == Sharding::kReleased) == (hook != nullptr), "attach_sharding: a hook ",
              "comes with the released mode, and only with it; got mode '", sharding_name(sharding),
              "' ", hook ? "with" : "without", " a hook");
  // A user's hook stays under a sharder that keeps the gradients whole; one that keeps
  // its range replaces the reduction, which a user's hook owns.
  TORCH_CHECK(!hook || plan_.wire.has_value() || plan_.sharding == Sharding::kReleased,
              "a communication hook is registered on this DDP; a sharder cannot replace it");
  const bool hook_changes = hook || plan_.sharding == Sharding::kReleased;
  if (hook) {
    ext_.hook = std::move(hook);
  } else if (plan_.sharding == Sharding::kReleased) {  // its hook goes: the default again
    ext_.hook = std::make_unique<AllreduceSumHook>(pg_, options_.inline_collectives,
                                                   options_.wire_format);
  }
  if (hook_changes) {  // other collectives from here: the wire's error feedback restarts
    for (const auto& bucket : layout_.buckets()) bucket->wire_residual.reset();
  }
  plan_.sharding = sharding;
  replan();
}

void Reducer::add_pre_launch(BucketCallback callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  ext_.pre_launch.push_back(std::move(callback));
  replan();
}

void Reducer::add_post_done(BucketCallback callback, bool reads_buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  ext_.post_done.push_back(std::move(callback));
  ext_.post_done_reads_buffer = ext_.post_done_reads_buffer || reads_buffer;
  replan();
}

void Reducer::set_divide_factor(int64_t factor) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK_VALUE(factor > 0, "divide factor must be positive, got ", factor);
  averaging_.divisor = factor;
}

void Reducer::note_shadowed_step(const std::optional<at::Tensor>& global_used) {
  std::lock_guard<std::mutex> lock(mutex_);
  usage_.note_shadowed(global_used);
  recorder_.end_step();
}

bool Reducer::tracks_usage() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return usage_.tracking();
}

bool Reducer::should_rebuild_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return recorder_.pending();
}

std::vector<size_t> Reducer::ready_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return recorder_.ready_order();
}

std::vector<int64_t> Reducer::ready_groups() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return recorder_.ready_groups();
}

std::vector<StepTimeline> Reducer::timelines(size_t n) const {
  std::vector<StepTimeline> steps;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    steps = timing_.last(n);
  }
  for (auto& step : steps) resolve_device_stamps(step);  // syncs device events; no lock held
  return steps;
}

}  // namespace pycomm::reducer
