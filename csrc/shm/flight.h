// The flight recorder of one "pycomm" group: the last operations this rank issued on it,
// each with what it was and how far it got, kept in memory and written out on demand or at
// the group's first failure (See Note [Flight recorder] in flight.cpp).
#pragma once

#include <csignal>
#include <functional>

#include <c10/core/ScalarType.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "comm/op_label.h"

namespace pycomm::shm {

constexpr size_t kFlightEntries = 2048;  // per group

enum class FlightState : uint8_t { kQueued, kStarted, kCompleted, kFailed };

struct FlightEntry {
  uint64_t seq = 0;  // the group's operation number (the "#N" of pycomm's errors)
  const char* op = "";  // a string literal: the operation's name
  int64_t bytes = 0;    // of its tensors, all together
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  comm::OpLabel label;  // a DDP bucket's, or none
  FlightState state = FlightState::kQueued;
  int64_t queued_ns = 0;  // CLOCK_REALTIME: comparable across the ranks of a host
  int64_t started_ns = 0;
  int64_t ended_ns = 0;
  std::string error;  // of a failed one
};

// Lock-free on the hot path: operation `seq` lives in slot seq % capacity (a group's
// operation numbers are consecutive), written by the thread that issues it and then by the
// one that runs it, each field an atomic; readers take a consistent-enough snapshot for a
// diagnosis. Only a failure's message takes a lock.
class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity) : slots_(capacity) {}

  void queued(uint64_t seq, const char* op, int64_t bytes, c10::ScalarType dtype,
              const comm::OpLabel& label);
  void started(uint64_t seq);
  void ended(uint64_t seq, const std::string& error);
  // The entries still held, oldest first.
  std::vector<FlightEntry> entries() const;
  // The entries as JSON (one object: rank, world, the entries), for merge tools.
  std::string json(int rank, int world) const;
  // Write json() to `path`; throws naming the path when it cannot.
  void write(const std::string& path, int rank, int world) const;

 private:
  struct Slot {
    std::atomic<uint64_t> seq{~uint64_t{0}};  // whose slot it is now (~0: nobody's yet)
    std::atomic<const char*> op{""};
    std::atomic<int64_t> bytes{0};
    std::atomic<int8_t> dtype{0};
    std::atomic<int64_t> bucket{-1}, forwards{0}, step{0};
    std::atomic<uint8_t> state{0};
    std::atomic<int64_t> queued_ns{0}, started_ns{0}, ended_ns{0};
  };
  Slot* slot_of(uint64_t seq);  // null once the ring has moved past it

  std::vector<Slot> slots_;
  std::atomic<uint64_t> newest_{~uint64_t{0}};  // the last seq queued
  mutable std::mutex errors_mutex_;
  std::vector<std::pair<uint64_t, std::string>> errors_;  // the failed ones' messages
};

// Where the flight records go at a group's first failure: $PYCOMM_FLIGHT_RECORD_DIR, or ""
// (then nothing is written; the records stay readable in memory).
std::string flight_record_dir();

// The signal that makes every live group write its record into flight_record_dir() (See
// Note [Flight records on a signal] in flight.cpp).
constexpr int kFlightDumpSignal = SIGUSR2;

// While registered, `write(dir)` runs (on a thread of its own) when the process receives
// kFlightDumpSignal and $PYCOMM_FLIGHT_RECORD_DIR was set at the first registration;
// unregister waits for a write that is running. `owner` is the key. Returns whether the
// signal's handler is pycomm's (so that a peer may send it: See Note [Every rank dumps]).
bool register_flight_dump(const void* owner, std::function<void(const std::string&)> write);
void unregister_flight_dump(const void* owner);

}  // namespace pycomm::shm
