// Parameter usage and static_graph's hook counts (see usage.h).
#include "reducer/usage.h"

#include <unordered_set>

#include "reducer/comm_hook.h"

namespace pycomm::reducer {

Usage::Usage(size_t count, int64_t rank, bool find_unused, bool static_graph)
    : rank_(rank),
      static_graph_(static_graph),
      find_unused_(find_unused),
      track_(find_unused || static_graph),
      local_(at::zeros({static_cast<int64_t>(count)}, at::kInt)),
      static_unused_(count, 0),
      counts_(count, 0),
      expected_(count, 1) {}

void Usage::plan(const std::vector<at::Tensor>& outputs,
                 const std::vector<AccumulatorPtr>& accumulators) {
  unused_.clear();
  if (static_graph_ && !track_) {
    // This rank's own unused set, learned in the first step (torch's unused_parameters_).
    for (size_t i = 0; i < expected_.size(); ++i) {
      if (expected_[i] == 0) unused_.push_back(i);
    }
    return;
  }
  if (!find_unused_ || static_graph_) return;
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && seen.insert(edge.function.get()).second)
      stack.push_back(edge.function.get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) {
        stack.push_back(edge.function.get());
      }
    }
  }
  for (size_t i = 0; i < accumulators.size(); ++i) {
    if (!seen.count(accumulators[i].get())) unused_.push_back(i);
  }
}

// Note [Static graph hook counts]
// A parameter's gradient hook may fire several times in one backward: a layer run in
// several torch.utils.checkpoint(use_reentrant=True) segments accumulates into .grad once
// per segment's nested backward. With static_graph the first step only counts the hooks
// (its buckets are filled and launched together at the end of backward, in finalize, as
// torch's delayed first-step all-reduce does: the first step does not overlap), and from
// the second step a parameter is ready at its last expected hook. Parameters no hook
// reached on this rank in the first step are this rank's unused set from then on.
Usage::Hook Usage::count_hook(size_t index, const std::string& name) {
  const int32_t seen = ++counts_[index];
  if (counting_hooks()) return {seen == 1, true};
  TORCH_CHECK(seen <= expected_[index], "pycomm DDP (rank ", rank_, "): parameter ", name,
              " received ", seen, " gradient hooks in this backward, but ", expected_[index],
              " in the first step: static_graph=True needs the same "
              "graph every step (the same parameters used the same number of times)");
  return {seen == 1, seen < expected_[index]};
}

const std::vector<int32_t>& Usage::end_counting() {
  expected_ = counts_;
  return expected_;
}

void Usage::start_allreduce(const comm::ProcessGroupPtr& pg, c10::Device device) {
  // Usage is summed across ranks after the last bucket (see Note [Bucket order]).
  // On an accelerator: a pinned, non-blocking copy, so backward never waits for it.
  at::Tensor used = local_.clone();
  if (!device.is_cpu()) used = used.pin_memory().to(device, /*non_blocking=*/true);
  future_ = comm::start_allreduce(pg, used, c10d::ReduceOp::SUM)->getFuture();
}

void Usage::wait_sum() {
  if (!future_) return;
  future_->wait();
  TORCH_CHECK(!future_->hasError(), "pycomm DDP (rank ", rank_,
              "): the all-reduce of parameter usage failed: ", comm::error_message(*future_));
  global_ = result_tensor(future_->value()).to(at::kCPU);
  local_.zero_();
}

void Usage::end_step() {
  if (!static_graph_ || !track_) return;
  const int32_t* used = global_.data_ptr<int32_t>();
  for (size_t i = 0; i < static_unused_.size(); ++i) static_unused_[i] = used[i] == 0;
  track_ = false;
}

bool Usage::globally_unused(size_t index) const {
  if (track_) return global_.data_ptr<int32_t>()[index] == 0;
  return static_graph_ && static_unused_[index] != 0;
}

void Usage::note_shadowed(const std::optional<at::Tensor>& global_used) {
  if (!global_used || !static_graph_ || !track_) return;
  const at::Tensor used = global_used->to(at::kCPU, at::kInt).contiguous();
  TORCH_CHECK_VALUE(used.numel() == static_cast<int64_t>(expected_.size()),
                    "note_shadowed_step: usage of ", used.numel(), " parameters, expected ",
                    expected_.size());
  const int32_t* counts = used.data_ptr<int32_t>();
  for (size_t i = 0; i < expected_.size(); ++i) {
    static_unused_[i] = counts[i] == 0;
    expected_[i] = counts[i] == 0 ? 0 : 1;  // this rank never ran a step
  }
  track_ = false;
}

void Usage::reset_step() {
  std::fill(counts_.begin(), counts_.end(), 0);
  future_.reset();
}

}  // namespace pycomm::reducer
