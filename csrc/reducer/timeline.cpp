// Device stamps of the timeline (see Note [Timeline] in timeline.h).
#include "reducer/timeline.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

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
  }
  step.device.reset();
}

}  // namespace pycomm::reducer
