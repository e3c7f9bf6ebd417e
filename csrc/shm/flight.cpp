// See flight.h.
#include "shm/flight.h"

#include <c10/util/Exception.h>

#include <semaphore.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "shm/collectives.h"

namespace pycomm::shm {

// Note [Flight recorder]
// A hang or a failed collective is explained by what each rank was doing: which operation
// it had issued last, which one it was waiting in, which it had finished. Every operation
// of a "pycomm" group (collectives, sends, receives; pycomm's DDP buckets with their step
// and bucket) is recorded when it is issued, when it starts and when it ends, in a ring of
// the last kFlightEntries per group: relaxed atomic stores into the slot of its operation
// number and three clock reads, no lock (a failure's message takes one). The
// records are read with pycomm.shm.flight_record(group), written with
// pycomm.shm.dump_flight_record(path, group), and written by the backend itself at the
// group's first failure (a timeout, a dead peer, ranks in different collectives) into
// $PYCOMM_FLIGHT_RECORD_DIR when it is set, one JSON file per rank.
// `python -m pycomm.flight_record DIR` merges the ranks' files and says which rank is
// behind at which operation. Timestamps are CLOCK_REALTIME in ns, comparable across the
// ranks of one host and, with synchronized clocks, across hosts, at the kernel tick's
// granularity (see coarse_wall_ns).

namespace {

int64_t wall_ns(clockid_t clock = CLOCK_REALTIME) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// An operation's times: the kernel's tick-granular wall clock (a few ms), a quarter of the
// precise clock's cost, which the smallest collectives would feel three times over. The
// records order operations by number; the times say roughly when, and how long a wait
// lasted, at that granularity.
int64_t coarse_wall_ns() { return wall_ns(CLOCK_REALTIME_COARSE); }

const char* state_name(FlightState s) {
  switch (s) {
    case FlightState::kQueued: return "queued";
    case FlightState::kStarted: return "started";
    case FlightState::kCompleted: return "completed";
    case FlightState::kFailed: return "failed";
  }
  return "?";
}

void json_string(std::ostringstream& out, const std::string& s) {
  out << '"';
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out << buf;
    } else {
      out << c;
    }
  }
  out << '"';
}

}  // namespace

void FlightRecorder::queued(uint64_t seq, const char* op, int64_t bytes, c10::ScalarType dtype,
                            const comm::OpLabel& label) {
  Slot& s = slots_[seq % slots_.size()];
  s.seq.store(~uint64_t{0}, std::memory_order_relaxed);  // being rewritten
  std::atomic_thread_fence(std::memory_order_release);
  s.op.store(op, std::memory_order_relaxed);
  s.bytes.store(bytes, std::memory_order_relaxed);
  s.dtype.store(static_cast<int8_t>(dtype), std::memory_order_relaxed);
  s.bucket.store(label.bucket, std::memory_order_relaxed);
  s.forwards.store(label.forwards, std::memory_order_relaxed);
  s.step.store(label.step, std::memory_order_relaxed);
  s.state.store(static_cast<uint8_t>(FlightState::kQueued), std::memory_order_relaxed);
  s.queued_ns.store(coarse_wall_ns(), std::memory_order_relaxed);
  s.started_ns.store(0, std::memory_order_relaxed);
  s.ended_ns.store(0, std::memory_order_relaxed);
  s.seq.store(seq, std::memory_order_release);
  newest_.store(seq, std::memory_order_release);
}

FlightRecorder::Slot* FlightRecorder::slot_of(uint64_t seq) {
  Slot& s = slots_[seq % slots_.size()];
  return s.seq.load(std::memory_order_acquire) == seq ? &s : nullptr;
}

void FlightRecorder::started(uint64_t seq) {
  if (Slot* s = slot_of(seq)) {
    s->started_ns.store(coarse_wall_ns(), std::memory_order_relaxed);
    s->state.store(static_cast<uint8_t>(FlightState::kStarted), std::memory_order_release);
  }
}

void FlightRecorder::ended(uint64_t seq, const std::string& error) {
  Slot* s = slot_of(seq);
  if (s == nullptr) return;
  if (!error.empty()) {
    std::lock_guard<std::mutex> lock(errors_mutex_);
    errors_.emplace_back(seq, error);
    if (errors_.size() > slots_.size()) errors_.erase(errors_.begin());
  }
  s->ended_ns.store(coarse_wall_ns(), std::memory_order_relaxed);
  s->state.store(static_cast<uint8_t>(error.empty() ? FlightState::kCompleted
                                                    : FlightState::kFailed),
                 std::memory_order_release);
}

std::vector<FlightEntry> FlightRecorder::entries() const {
  std::vector<FlightEntry> out;
  const uint64_t newest = newest_.load(std::memory_order_acquire);
  if (newest == ~uint64_t{0}) return out;
  const uint64_t held = std::min<uint64_t>(newest + 1, slots_.size());
  std::lock_guard<std::mutex> lock(errors_mutex_);
  for (uint64_t seq = newest + 1 - held; seq <= newest; ++seq) {
    const Slot& s = slots_[seq % slots_.size()];
    if (s.seq.load(std::memory_order_acquire) != seq) continue;  // being rewritten
    FlightEntry e;
    e.seq = seq;
    e.op = s.op.load(std::memory_order_relaxed);
    e.bytes = s.bytes.load(std::memory_order_relaxed);
    e.dtype = static_cast<c10::ScalarType>(s.dtype.load(std::memory_order_relaxed));
    e.label = comm::OpLabel{s.bucket.load(std::memory_order_relaxed),
                            s.forwards.load(std::memory_order_relaxed),
                            s.step.load(std::memory_order_relaxed)};
    e.state = static_cast<FlightState>(s.state.load(std::memory_order_acquire));
    e.queued_ns = s.queued_ns.load(std::memory_order_relaxed);
    e.started_ns = s.started_ns.load(std::memory_order_relaxed);
    e.ended_ns = s.ended_ns.load(std::memory_order_relaxed);
    for (const auto& [failed, what] : errors_) {
      if (failed == seq) e.error = what;
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::string FlightRecorder::json(int rank, int world) const {
  std::ostringstream out;
  out << "{\"format\": \"pycomm-flight-record-1\", \"rank\": " << rank << ", \"world\": " << world
      << ", \"written_ns\": " << wall_ns() << ", \"entries\": [";
  bool first = true;
  for (const FlightEntry& e : entries()) {
    out << (first ? "" : ", ") << "{\"seq\": " << e.seq << ", \"op\": ";
    json_string(out, e.op);
    out << ", \"bytes\": " << e.bytes << ", \"dtype\": ";
    json_string(out, e.dtype == c10::ScalarType::Undefined ? "" : dtype_name(e.dtype));
    out << ", \"bucket\": " << e.label.bucket << ", \"forwards\": " << e.label.forwards
        << ", \"step\": " << e.label.step << ", \"state\": \"" << state_name(e.state)
        << "\", \"queued_ns\": " << e.queued_ns << ", \"started_ns\": " << e.started_ns
        << ", \"ended_ns\": " << e.ended_ns << ", \"error\": ";
    json_string(out, e.error);
    out << "}";
    first = false;
  }
  out << "]}\n";
  return out.str();
}

void FlightRecorder::write(const std::string& path, int rank, int world) const {
  const std::string text = json(rank, world);
  std::FILE* f = std::fopen(path.c_str(), "w");
  TORCH_CHECK(f != nullptr, "pycomm: cannot write the flight record to ", path, ": ",
              std::strerror(errno));
  const size_t written = std::fwrite(text.data(), 1, text.size(), f);
  const bool closed = std::fclose(f) == 0;
  TORCH_CHECK(written == text.size() && closed, "pycomm: writing the flight record to ", path,
              " failed: ", std::strerror(errno));
}

std::string flight_record_dir() {
  const char* dir = std::getenv("PYCOMM_FLIGHT_RECORD_DIR");
  return dir == nullptr ? std::string() : std::string(dir);
}

// Note [Flight records on a signal]
// A rank that hangs writes its record only when its group fails on it, at the group's
// timeout. To look before that, send every rank SIGUSR2 (kFlightDumpSignal):
// `pkill -USR2 -f train.py`, or torchrun's workers by pid. Python's own signal handlers
// cannot do it: they run on the main thread between bytecodes, and a hung rank's main
// thread is inside a collective's wait in C++. So when $PYCOMM_FLIGHT_RECORD_DIR is set
// and the signal has no handler yet, the first "pycomm" group installs a C handler that
// only posts a semaphore (async-signal-safe), and a thread of pycomm's, waiting on it,
// writes every live group's record into the directory (the same files as at a failure).
// A handler the program installed first is left alone (no dump then: the docs say so),
// and the signal keeps its default (terminate) where the variable is not set.
namespace {

struct FlightDumps {
  std::mutex mutex;  // writers, and a write that is running
  std::map<const void*, std::function<void(const std::string&)>> writers;
  sem_t wake;
  bool installed = false;
  bool ours = false;  // the handler is on_flight_signal
};

FlightDumps& flight_dumps() {
  static FlightDumps* dumps = new FlightDumps();  // never destroyed: its thread outlives main
  return *dumps;
}

sem_t* g_flight_wake = nullptr;  // what the handler posts, set before it is installed

extern "C" void on_flight_signal(int /*signal*/) {
  if (g_flight_wake != nullptr) sem_post(g_flight_wake);
}

void write_on_signal(FlightDumps* dumps) {
  for (;;) {
    if (sem_wait(&dumps->wake) != 0) continue;  // EINTR
    const std::string dir = flight_record_dir();
    std::lock_guard<std::mutex> lock(dumps->mutex);
    for (const auto& entry : dumps->writers) {
      try {
        entry.second(dir);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "pycomm: could not write the flight record into %s: %s\n", dir.c_str(),
                     e.what());
      }
    }
  }
}

// Under dumps.mutex.
void install_flight_signal(FlightDumps& dumps) {
  if (dumps.installed || flight_record_dir().empty()) return;
  dumps.installed = true;
  struct sigaction current{};
  if (sigaction(kFlightDumpSignal, nullptr, &current) != 0 || current.sa_handler != SIG_DFL ||
      (current.sa_flags & SA_SIGINFO) != 0) {
    return;  // the program's own handler
  }
  if (sem_init(&dumps.wake, 0, 0) != 0) return;
  g_flight_wake = &dumps.wake;
  std::thread(write_on_signal, &dumps).detach();
  struct sigaction action{};
  action.sa_handler = on_flight_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  dumps.ours = sigaction(kFlightDumpSignal, &action, nullptr) == 0;
}

}  // namespace

bool register_flight_dump(const void* owner, std::function<void(const std::string&)> write) {
  FlightDumps& dumps = flight_dumps();
  std::lock_guard<std::mutex> lock(dumps.mutex);
  dumps.writers[owner] = std::move(write);
  install_flight_signal(dumps);
  return dumps.ours;
}

void unregister_flight_dump(const void* owner) {
  FlightDumps& dumps = flight_dumps();
  std::lock_guard<std::mutex> lock(dumps.mutex);
  dumps.writers.erase(owner);
}

}  // namespace pycomm::shm
