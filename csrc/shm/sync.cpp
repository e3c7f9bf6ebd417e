// Spin-then-futex waits with deadlines and liveness checks (see sync.h).
#include "shm/sync.h"

#include <c10/util/Exception.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>

namespace pycomm::shm {

namespace {

// Note [Adaptive spin]
// Spinning pays when the awaited rank runs on another core (it arrives within a few µs)
// and wastes the core when it does not (an oversubscribed or busy machine). Each Sync
// keeps a spin budget, learned from how long the peers actually took:
// - a spin that succeeds doubles the budget (up to the cap);
// - a wait that had to sleep reads when the peer published (Signal::published_ns): had
//   the peer come within the cap, the budget grows to twice that delay, else it halves
//   (down to kMinSpinNs, a lone check). Deciding on the peer's real delay, not on the
//   failed spin, matters: a budget halved on failures alone collapsed to 0.5 µs and
//   stayed there (no spin that short ever succeeds again), every wait slept, and a
//   4-byte all_reduce took 60-100 µs instead of 7-15 µs for the rest of the process.
// The cap depends on who waits:
// - the thread that issued the operation and blocks on it anyway (a blocking call, or a
//   waiter running queued work, See Note [Waiting helps]): kPatientSpinNs. It must exceed
//   the cost of a futex sleep, or one late peer starts a cascade: on this project's 2-vCPU
//   VM a futex wake-up takes 60-250 µs, so a rank that slept is late for the next
//   operation, whose peer outspins a 30 µs budget and sleeps in turn. Measured, 2 ranks,
//   blocking 4-byte all_reduce: with a 30 µs cap 28-45% of waits slept and a call took
//   64-90 µs; with 200 µs none slept and a call took 9-14 µs. A wake-up can still take
//   longer than the cap, so a patient waiter whose budget runs out while a rank is still
//   asleep on its own step counter (woken by this rank's publish, not yet running:
//   `transit`) keeps spinning, up to kTransitSpinNs: that peer is late by a wake-up, not
//   busy.
// - a lane's worker thread (asynchronous operations, DDP's buckets): kMaxSpinNs, short,
//   because the issuing thread of the same process is computing meanwhile and a spinning
//   worker takes its core.
constexpr int64_t kMaxSpinNs = 30'000;
constexpr int64_t kPatientSpinNs = 200'000;
constexpr int64_t kMinSpinNs = 500;
constexpr int64_t kTransitSpinNs = 1'000'000;
// How often a sleeping rank wakes to check the deadline and whether its peer still lives.
constexpr auto kSlice = std::chrono::milliseconds(20);
constexpr int kSpinsPerClockRead = 64;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

uint32_t* futex_word(const Signal& s) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint32_t>*>(&s.value));
}

void futex_wait(const Signal& s, uint32_t expected, std::chrono::nanoseconds timeout) {
  auto secs = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec ts{static_cast<time_t>(secs.count()), static_cast<long>((timeout - secs).count())};
  // Shared (not FUTEX_PRIVATE): the word lives in memory mapped by several processes.
  syscall(SYS_futex, futex_word(s), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(const Signal& s) {
  syscall(SYS_futex, futex_word(s), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// A zombie still answers kill(pid, 0): read its state from /proc as well.
bool process_gone(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  char state = line[close + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace

void throw_op_error(const OpContext& ctx, const std::string& what) {
  std::ostringstream msg;
  msg << "pycomm " << ctx.op << " (operation #" << ctx.seq << " on rank " << ctx.rank
      << "): " << what;
  C10_THROW_ERROR(DistBackendError, msg.str());
}

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace

void Sync::publish(Signal& signal, uint32_t value) {
  signal.published_ns.store(now_ns(), std::memory_order_relaxed);
  // seq_cst on both sides pairs with the sleeper's increment-then-recheck in wait():
  // either the writer sees a sleeper, or the sleeper sees the new value.
  signal.value.store(value, std::memory_order_seq_cst);
  if (signal.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(signal);
}

namespace {

// Relaxed: the budget is a hint, and counters are read only for statistics.
template <typename T>
void bump(std::atomic<T>& counter) {
  counter.store(counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

}  // namespace

bool Sync::spin_until(const Signal& signal, uint32_t target, int64_t cap,
                      const Signal* transit) const {
  const int64_t budget = spin_ns_.load(std::memory_order_relaxed);
  const auto start = Clock::now();
  auto stop = start + std::chrono::nanoseconds(std::min(budget, cap));
  bool prolonged = false;
  while (true) {
    for (int i = 0; i < kSpinsPerClockRead; ++i) {
      if (reached(signal.value.load(std::memory_order_acquire), target)) {
        spin_ns_.store(std::min(cap, budget * 2), std::memory_order_relaxed);
        return true;
      }
      cpu_relax();
    }
    const auto now = Clock::now();
    if (now >= stop) {
      if (transit != nullptr && transit->sleepers.load(std::memory_order_relaxed) != 0 &&
          now - start < std::chrono::nanoseconds(kTransitSpinNs)) {
        stop = now + std::chrono::nanoseconds(kMaxSpinNs);
        if (!prolonged) bump(transit_);
        prolonged = true;
        continue;
      }
      return false;
    }
  }
}

void Sync::learn(const Signal& signal, int64_t since_ns, int64_t cap) const {
  const int64_t delay = signal.published_ns.load(std::memory_order_relaxed) - since_ns;
  const int64_t budget = spin_ns_.load(std::memory_order_relaxed);
  spin_ns_.store(delay >= 0 && delay < cap ? std::min(cap, std::max(budget * 2, delay * 2))
                                           : std::max(kMinSpinNs, budget / 2),
                 std::memory_order_relaxed);
}

WaitStats Sync::stats() const {
  WaitStats w;
  w.waits = waits_.load(std::memory_order_relaxed);
  w.spun = spun_.load(std::memory_order_relaxed);
  w.slept = slept_.load(std::memory_order_relaxed);
  w.transit = transit_.load(std::memory_order_relaxed);
  w.spin_budget_ns = spin_ns_.load(std::memory_order_relaxed);
  return w;
}

void Sync::wait(const Signal& signal, uint32_t target, int peer, const OpContext& ctx,
                const Signal* transit) const {
  if (reached(signal.value.load(std::memory_order_acquire), target)) return;
  bump(waits_);
  const int64_t cap = ctx.patient ? kPatientSpinNs : kMaxSpinNs;
  const int64_t since = now_ns();
  if (spin_ && spin_until(signal, target, cap, ctx.patient ? transit : nullptr)) {
    bump(spun_);
    return;
  }
  bump(slept_);
  auto& s = const_cast<Signal&>(signal);
  auto next_check = Clock::now() + kSlice;
  while (true) {
    s.sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = s.value.load(std::memory_order_seq_cst);
    if (!reached(v, target)) futex_wait(s, v, kSlice);
    s.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(s.value.load(std::memory_order_acquire), target)) {
      if (spin_) learn(s, since, cap);
      return;
    }
    auto now = Clock::now();
    if (now >= ctx.deadline) {
      fail(ctx, peer,
           "Timed out after " + std::to_string(ctx.timeout.count()) + " ms waiting for rank " +
               std::to_string(peer));
    }
    if (now >= next_check) {
      check_alive(peer, ctx);
      next_check = now + kSlice;
    }
  }
}

void Sync::check_alive(int peer, const OpContext& ctx) const {
  if (process_gone(segment_.rank(peer).pid.load())) {
    fail(ctx, peer, "rank " + std::to_string(peer) + " exited while this rank waited for it");
  }
}

void Sync::fail(const OpContext& ctx, int peer, const std::string& what) const {
  throw_op_error(ctx, what + " (pid " + std::to_string(segment_.rank(peer).pid.load()) + ")");
}

}  // namespace pycomm::shm
