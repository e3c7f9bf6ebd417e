// Which parameters take part in a step: the usage that find_unused_parameters (and
// static_graph's first step) sums across ranks, and static_graph's per-parameter hook
// counts. Owns those fields; the reducer asks it at forward, at each hook and at finalize.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>
#include <string>
#include <vector>

#include "comm/c10d.h"
#include "reducer/bucket.h"

namespace pycomm::reducer {

// shared_ptr<Node> before torch 2.12, intrusive_ptr<Node> since.
using AccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// Note [Parameter usage]
// - find_unused_parameters without static_graph: each synchronized forward walks the
//   graph from the outputs (plan); parameters it does not reach are marked ready (zero)
//   when backward starts. Every hook sets the parameter's entry of `local_`; after the
//   last bucket launches, `local_` is summed across ranks (start_allreduce), and finalize
//   leaves param.grad alone for a parameter no rank used (globally_unused).
// - static_graph: the first step tracks usage the same way and counts hooks (Note [Static
//   graph hook counts]); at its end the summed usage is this rank's static unused set and
//   tracking stops for good (tracking() turns false), as it does when a joined rank
//   shadows that step (note_shadowed).
// Invariants: `local_` is all zeros between synchronized steps (a reduced or discarded
// step clears it; no_sync hooks add to it, as torch's do); `global_` is the result of the
// last step reduced while tracking; `expected_` holds 1 per parameter until the first
// static_graph step sets it.
class Usage {
 public:
  Usage(size_t count, int64_t rank, bool find_unused, bool static_graph);

  // Whether the next synchronized step all-reduces usage after its last bucket.
  bool tracking() const { return track_; }
  // static_graph's first step: hooks are counted, nothing is launched before finalize.
  bool counting_hooks() const { return static_graph_ && track_; }

  // A synchronized forward: decides which parameters are marked unused at backward start.
  void plan(const std::vector<at::Tensor>& outputs,
            const std::vector<AccumulatorPtr>& accumulators);
  const std::vector<size_t>& unused() const { return unused_; }

  // Every gradient hook, inside no_sync too.
  void note_hook(size_t index) {
    if (track_) local_.data_ptr<int32_t>()[index] = 1;
  }
  struct Hook {
    bool first;    // the parameter's first hook this backward
    bool pending;  // more hooks are expected before it is ready (or they are only counted)
  };
  // static_graph: count one hook of parameter `index` (named `name` in errors).
  Hook count_hook(size_t index, const std::string& name);
  // The end of static_graph's first backward: per parameter, the hooks it saw, which every
  // later step expects.
  const std::vector<int32_t>& end_counting();

  // After the last bucket of a tracking step: sum `local_` across ranks (on `device`).
  void start_allreduce(const comm::ProcessGroupPtr& pg, c10::Device device);
  // finalize, before the grads are written: wait for the sum (globally_unused reads it).
  void wait_sum();
  // finalize, after: static_graph's first step leaves its unused set and stops tracking.
  void end_step();
  bool globally_unused(size_t index) const;
  // A joined rank shadowed the tracking step; `global_used` is its summed usage.
  void note_shadowed(const std::optional<at::Tensor>& global_used);

  void reset_step();
  void discard_step() { local_.zero_(); }  // a failed or abandoned step
  void drain() noexcept {
    if (future_) future_->wait();
  }

 private:
  int64_t rank_;
  bool static_graph_;
  bool find_unused_;
  bool track_;
  at::Tensor local_;   // int32 CPU, per parameter; summed across ranks
  at::Tensor global_;  // the summed result of the last tracking step
  FuturePtr future_;
  std::vector<uint8_t> static_unused_;
  std::vector<size_t> unused_;  // marked ready (zero) at backward start
  // static_graph: hooks seen per parameter this backward, and how many the first step saw.
  std::vector<int32_t> counts_;
  std::vector<int32_t> expected_;
};

}  // namespace pycomm::reducer
