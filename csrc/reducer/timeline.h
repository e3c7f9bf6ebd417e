// Per-step timing of the reducer (see Note [Timeline]): a bounded ring of the last steps.
// Owns storage only; the reducer decides when to stamp.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace pycomm::reducer {

// Note [Timeline]
// Every synchronized step the reducer stamps, with std::chrono::steady_clock in ns:
// the start of backward (first hook on an output's grad_fn, or the first parameter hook),
// each parameter's ready time (its grad landed in its bucket slot), each bucket's ready
// (last grad in), launch (collective issued) and done (the collective's future completed,
// stamped in its callback) times, and finalize start/end. That is one clock read per
// parameter plus three per bucket: cheap enough to stay on by default.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct BucketTimes {
  int64_t index = 0;
  int64_t nbytes = 0;
  std::vector<int64_t> param_indices;
  int64_t ready_ns = -1;
  int64_t launch_ns = -1;
  int64_t done_ns = -1;
};

struct StepTimeline {
  int64_t step = 0;
  int64_t rank = 0;
  int64_t backward_start_ns = -1;
  std::vector<int64_t> param_ready_ns;  // reducer parameter order; -1 when unused
  std::vector<BucketTimes> buckets;
  int64_t finalize_start_ns = -1;
  int64_t finalize_end_ns = -1;
};

class TimelineRing {
 public:
  explicit TimelineRing(size_t capacity) : capacity_(capacity) {}
  void push(StepTimeline step) {
    if (capacity_ == 0) return;
    if (steps_.size() == capacity_) steps_.pop_front();
    steps_.push_back(std::move(step));
  }
  // The last `n` steps, most recent last.
  std::vector<StepTimeline> last(size_t n) const {
    n = std::min(n, steps_.size());
    return {steps_.end() - static_cast<std::ptrdiff_t>(n), steps_.end()};
  }

 private:
  size_t capacity_;
  std::deque<StepTimeline> steps_;
};

}  // namespace pycomm::reducer
