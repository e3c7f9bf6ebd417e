// The recorded step: the one synchronized step whose gradient ready order (and gradient
// groups) seeds the one bucket rebuild, and whether that rebuild is due. Owns those
// fields; pycomm/ddp/ asks should_rebuild, broadcasts rank 0's order and rebuilds.
#pragma once

#include <optional>
#include <vector>

#include "reducer/usage.h"

namespace pycomm::reducer {

// Note [Bucket rebuild]
// As torch's DDP, buckets are first laid out in reverse parameter order, then rebuilt
// once from the order gradients became ready in the first synchronized step (the recorded
// step), so that a bucket fills at once in backward. A graph that may change every step
// (find_unused_parameters without static_graph) records nothing and keeps its layout.
// States: recording (a step is being recorded: every ready parameter is appended to
// `order_`, and the forward notes its gradient groups) -> pending (the step ended; the
// wrapper rebuilds before the next forward) -> rebuilt (never again). An abandoned step
// drops its partial order and stays recording; a joined rank's shadowed step counts as
// the recorded one, so it takes part in the same rebuild as the ranks that ran it.
class RebuildRecorder {
 public:
  RebuildRecorder(size_t count, bool find_unused, bool static_graph)
      : count_(count), recording_(!find_unused || static_graph) {}

  bool recording() const { return recording_; }
  // A synchronized forward of the recorded step: note its gradient groups.
  void plan(const std::vector<at::Tensor>& outputs,
            const std::vector<AccumulatorPtr>& accumulators) {
    if (recording_ && !rebuilt_) note_groups(outputs, accumulators);
  }
  void note_ready(size_t index) {
    if (recording_) order_.push_back(index);
  }
  void discard_partial() {
    if (recording_) order_.clear();  // a partial ready order must not seed the rebuild
  }
  void end_step() {
    if (!recording_) return;
    recording_ = false;
    pending_ = !rebuilt_;
  }
  // The buckets were laid out again; the first layout after the recorded step is the rebuild.
  void note_rebuilt() {
    if (!pending_) return;
    pending_ = false;
    rebuilt_ = true;
  }
  bool pending() const { return pending_; }

  // Parameter indices in the order their grads became ready in the recorded step,
  // completed with the never-ready ones (reverse index order) so every rank has them all.
  std::vector<size_t> ready_order() const;
  // Per parameter, its gradient group in the recorded step (See Note [Gradient groups]).
  std::vector<int64_t> ready_groups() const;

 private:
  void note_groups(const std::vector<at::Tensor>& outputs,
                   const std::vector<AccumulatorPtr>& accumulators);

  size_t count_;
  bool recording_;
  bool pending_ = false;
  bool rebuilt_ = false;
  std::vector<size_t> order_;
  std::vector<int64_t> groups_;  // empty: each parameter alone
};

}  // namespace pycomm::reducer
