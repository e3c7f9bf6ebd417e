// The reducer's step timing and device stamps (see Note [Timeline] in timeline.h).
#include "reducer/timeline.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cmath>

namespace pycomm::reducer {

int64_t DeviceStamps::stamp() {
  if (!device_) return -1;
  const auto* impl = c10::impl::getDeviceGuardImpl(device_->type());
  std::lock_guard<std::mutex> lock(mutex_);
  events_.emplace_back(device_->type(), c10::EventFlag::BACKEND_DEFAULT);
  events_.back().record(impl->getStream(*device_));
  return static_cast<int64_t>(events_.size()) - 1;
}

std::vector<int64_t> DeviceStamps::resolve() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!device_ || events_.empty()) return {};
  for (const auto& event : events_) event.synchronize();
  const auto* impl = c10::impl::getDeviceGuardImpl(device_->type());
  c10::Event anchor(device_->type(), c10::EventFlag::BACKEND_DEFAULT);
  anchor.record(impl->getStream(*device_));
  anchor.synchronize();
  const int64_t anchor_ns = now_ns();  // the stream was idle: anchor ran just now
  std::vector<int64_t> out;
  out.reserve(events_.size());
  for (const auto& event : events_) {
    out.push_back(anchor_ns - std::llround(event.elapsedTime(anchor) * 1e6));
  }
  return out;
}

void resolve_device_stamps(StepTimeline& step) {
  if (!step.device) return;
  const std::vector<int64_t> ns = step.device->resolve();
  for (auto& bucket : step.buckets) {
    if (bucket.ready_stamp >= 0) bucket.ready_ns = ns.at(bucket.ready_stamp);
    if (bucket.done_stamp >= 0) bucket.done_ns = ns.at(bucket.done_stamp);
    if (bucket.ready_stamp >= 0) {  // See Note [Timeline]: launch and done on the device
      bucket.launch_ns = std::max(bucket.launch_ns, bucket.ready_ns);
      bucket.done_ns = std::max(bucket.done_ns, bucket.launch_ns);
    }
  }
  step.device.reset();
}

void StepTiming::push(int64_t step_index, int64_t rank, const BucketLayout& layout,
                      int64_t finalize_start_ns, bool manual_finalization) {
  StepTimeline step;
  step.step = step_index;
  step.rank = rank;
  step.backward_start_ns = backward_start_ns_;
  step.param_ready_ns = ready_ns_;
  step.buckets.reserve(layout.size());
  for (const auto& bucket : layout.buckets()) {
    BucketTimes times;
    times.index = static_cast<int64_t>(bucket->index);
    times.nbytes = bucket->nbytes();
    times.param_indices.assign(bucket->params.begin(), bucket->params.end());
    times.ready_ns = bucket->ready_ns;
    times.launch_ns = bucket->launch_ns;
    times.done_ns = bucket->done_ns.load();
    times.in_place = in_place(bucket->path);
    times.ready_stamp = bucket->ready_stamp;
    times.done_stamp = bucket->done_stamp.load();
    step.buckets.push_back(std::move(times));
  }
  step.finalize_start_ns = finalize_start_ns;
  step.finalize_end_ns = now_ns();
  step.manual_finalization = manual_finalization;
  step.device = std::move(stamps_);
  ring_.push(std::move(step));
}

}  // namespace pycomm::reducer
