// Per-step timing of the reducer (see Note [Timeline]): a bounded ring of the last steps.
// Owns storage only; the reducer decides when to stamp.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
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
// On an accelerator a host read at hook time says when work was enqueued, not when it ran,
// so bucket ready and done are also stamped with device events (DeviceStamps) on the
// current stream, without any sync; they are converted to steady_clock ns only when the
// timeline is read (timelines()), against an anchor event synchronized then.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Device events of one step (inactive on CPU). stamp() is thread-safe: buckets complete on
// communication threads.
class DeviceStamps {
 public:
  explicit DeviceStamps(std::optional<c10::Device> device) : device_(device) {}
  bool active() const { return device_.has_value(); }
  // Record an event on the device's current stream; its id, or -1 when inactive.
  int64_t stamp();
  // Wait for every event and convert each to steady_clock ns (index = id).
  std::vector<int64_t> resolve() const;

 private:
  std::optional<c10::Device> device_;
  mutable std::mutex mutex_;
  std::vector<c10::Event> events_;
};

struct BucketTimes {
  int64_t index = 0;
  int64_t nbytes = 0;
  std::vector<int64_t> param_indices;
  int64_t ready_ns = -1;
  int64_t launch_ns = -1;
  int64_t done_ns = -1;
  bool in_place = false;     // reduced in param.grad (Note [Gradients reduced in place])
  int64_t ready_stamp = -1;  // DeviceStamps ids, -1 on CPU
  int64_t done_stamp = -1;
};

struct StepTimeline {
  int64_t step = 0;
  int64_t rank = 0;
  int64_t backward_start_ns = -1;
  std::vector<int64_t> param_ready_ns;  // reducer parameter order; -1 when unused
  std::vector<BucketTimes> buckets;
  int64_t finalize_start_ns = -1;
  int64_t finalize_end_ns = -1;
  std::shared_ptr<DeviceStamps> device;  // null on CPU
};

// Replace host stamps of a device step by its resolved device stamps.
void resolve_device_stamps(StepTimeline& step);

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
