// Waiting on another rank's Signal: a brief adaptive spin, then FUTEX_WAIT in time slices, each
// slice bounded by the operation's deadline and followed by a liveness check of the rank
// waited for. Every wait either returns or throws c10::DistBackendError naming the
// operation and the rank; nothing here loops without sleeping.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "comm/op_label.h"
#include "shm/segment.h"

namespace pycomm::shm {

using Clock = std::chrono::steady_clock;

// What the current wait belongs to, for error messages and the deadline.
struct OpContext {
  const char* op = "";
  uint64_t seq = 0;
  int rank = 0;
  std::chrono::milliseconds timeout{0};
  Clock::time_point deadline;
  // The thread running the operation would block anyway (not a lane's worker): it may
  // spin longer (See Note [Adaptive spin]).
  bool patient = false;
  // What the caller says this collective reduces (a DDP bucket's), compared across ranks.
  comm::OpLabel label;
};

// `value` has reached `target` (modular: counters wrap around 2^32).
inline bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// Counts of one Sync's waits since the group was created (see ShmBackend::stats).
struct WaitStats {
  uint64_t waits = 0;    // the value was not there yet on the first look
  uint64_t spun = 0;     // ... and arrived while spinning
  uint64_t slept = 0;    // ... or only after a futex sleep
  uint64_t transit = 0;  // spins prolonged because a peer was being woken
  int64_t spin_budget_ns = 0;
};

class Sync {
 public:
  Sync(const Segment& segment, bool spin) : segment_(segment), spin_(spin) {}

  // Store `value` (release) and wake the ranks asleep on it.
  static void publish(Signal& signal, uint32_t value);

  // Return once `signal` (written by rank `peer`) reaches `target`; throw on deadline or
  // when `peer` is gone. `transit`: this rank's own signal, on which a peer that sleeps
  // is being woken (See Note [Adaptive spin]).
  void wait(const Signal& signal, uint32_t target, int peer, const OpContext& ctx,
            const Signal* transit = nullptr) const;

  WaitStats stats() const;

 private:
  bool spin_until(const Signal& signal, uint32_t target, int64_t cap, const Signal* transit) const;
  // After a wait that slept: adapt the spin budget to when the peer really published.
  void learn(const Signal& signal, int64_t since_ns, int64_t cap) const;
  void check_alive(int peer, const OpContext& ctx) const;
  [[noreturn]] void fail(const OpContext& ctx, int peer, const std::string& what) const;

  const Segment& segment_;
  bool spin_;
  // See Note [Adaptive spin]. One operation at a time waits on a Sync; atomics (relaxed)
  // only so that stats() may read them from another thread.
  mutable std::atomic<int64_t> spin_ns_{30'000};
  mutable std::atomic<uint64_t> waits_{0}, spun_{0}, slept_{0}, transit_{0};
};

// Throw c10::DistBackendError with "pycomm <op> (...)" in front of `what`.
[[noreturn]] void throw_op_error(const OpContext& ctx, const std::string& what);

}  // namespace pycomm::shm
