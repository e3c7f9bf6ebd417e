// Which parameters take part in a backward: the graph traversal of
// find_unused_parameters, and static_graph's per-parameter hook counts (see reducer.h).
// When a parameter is ready is launch.cpp's.
#include <unordered_set>

#include "reducer/reducer.h"

namespace pycomm::reducer {

void Reducer::find_unused(const std::vector<at::Tensor>& outputs) {
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
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen.count(accumulators_[i].get())) unused_.push_back(i);
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
bool Reducer::static_hook_pending(size_t index) {
  if (options_.record_timeline) ready_ns_[index] = now_ns();
  const int32_t seen = ++hook_counts_[index];
  if (counting_hooks()) {
    if (seen == 1 && record_order_) order_.push_back(index);
    return true;
  }
  TORCH_CHECK(seen <= expected_hooks_[index], "pycomm DDP (rank ", rank_, "): parameter ",
              names_[index], " received ", seen, " gradient hooks in this backward, but ",
              expected_hooks_[index],
              " in the first step: static_graph=True needs the same "
              "graph every step (the same parameters used the same number of times)");
  return seen < expected_hooks_[index];
}

void Reducer::mark_counted() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (hook_counts_[i] == 0) ++buckets_[locator_[i].first]->unused;
  }
  for (size_t i = 0; i < params_.size(); ++i) mark_ready(i, /*used=*/hook_counts_[i] > 0);
  expected_hooks_ = hook_counts_;
}

}  // namespace pycomm::reducer
