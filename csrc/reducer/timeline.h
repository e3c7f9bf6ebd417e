// Per-step timing of the reducer (see Note [Timeline]): this step's stamps and a bounded
// ring of the last steps. StepTiming owns both; the reducer says when each event happens.
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

#include "reducer/bucket.h"

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
// timeline is read (timelines()), against an anchor event synchronized then. The launch
// stays a host stamp, and the host enqueues a bucket's collective before the device has
// produced its last gradient: the collective cannot start on the device before either, so
// its device launch is the later of the two (and its done no earlier than that, against
// the microseconds the anchor's conversion may be off).
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
  bool manual_finalization = false;  // finalize_start_ns is when the caller called it
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

// This step's stamps (backward start, each parameter's ready time, device events) and the
// ring of finished steps. Everything but a bucket's ready/launch/done times (which skipped
// buckets and failure messages use too) is taken only with record_timeline.
class StepTiming {
 public:
  StepTiming(size_t count, bool record, size_t steps)
      : record_(record), ready_ns_(count, -1), ring_(record ? steps : 0) {}

  bool recording() const { return record_; }
  void start_backward() {
    if (backward_start_ns_ < 0) backward_start_ns_ = now_ns();
  }
  // The first parameter hook of a step whose buckets are on `device`.
  void begin_step(c10::Device device) {
    start_backward();
    stamps_ = record_ && !device.is_cpu() ? std::make_shared<DeviceStamps>(device) : nullptr;
  }
  // A gradient hook of parameter `index`; `last` keeps the latest of several (static_graph).
  void param_ready(size_t index, bool last = false) {
    if (record_ && (last || ready_ns_[index] < 0)) ready_ns_[index] = now_ns();
  }
  void bucket_ready(Bucket& bucket) const {
    bucket.ready_ns = now_ns();
    if (stamps_) bucket.ready_stamp = stamps_->stamp();
  }
  // For the bucket's completion callback (null on CPU or without record_timeline).
  const std::shared_ptr<DeviceStamps>& stamps() const { return stamps_; }
  // The end of finalize: the step's record goes into the ring.
  void push(int64_t step, int64_t rank, const BucketLayout& layout, int64_t finalize_start_ns,
            bool manual_finalization);
  // The last `n` steps, most recent last; device stamps still unresolved.
  std::vector<StepTimeline> last(size_t n) const { return ring_.last(n); }
  void reset_step() {
    std::fill(ready_ns_.begin(), ready_ns_.end(), -1);
    backward_start_ns_ = -1;
  }

 private:
  bool record_;
  int64_t backward_start_ns_ = -1;
  std::vector<int64_t> ready_ns_;
  std::shared_ptr<DeviceStamps> stamps_;  // this step's device events; null on CPU
  TimelineRing ring_;
};

}  // namespace pycomm::reducer
