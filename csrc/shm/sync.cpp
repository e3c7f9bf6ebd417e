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
// and wastes the core when it does not (an oversubscribed or busy machine). The spin
// budget doubles (up to kMaxSpin) each time a spin succeeds and halves each time it runs
// out, down to kMinSpin: a lone check that still notices when the peers are back on cores.
constexpr int64_t kMaxSpinNs = 30'000;
constexpr int64_t kMinSpinNs = 500;
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
  timespec ts{static_cast<time_t>(secs.count()),
              static_cast<long>((timeout - secs).count())};
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

void Sync::publish(Signal& signal, uint32_t value) {
  // seq_cst on both sides pairs with the sleeper's increment-then-recheck in wait():
  // either the writer sees a sleeper, or the sleeper sees the new value.
  signal.value.store(value, std::memory_order_seq_cst);
  if (signal.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(signal);
}

bool Sync::spin_until(const Signal& signal, uint32_t target) const {
  auto stop = Clock::now() + std::chrono::nanoseconds(spin_ns_);
  while (true) {
    for (int i = 0; i < kSpinsPerClockRead; ++i) {
      if (reached(signal.value.load(std::memory_order_acquire), target)) {
        spin_ns_ = std::min(kMaxSpinNs, spin_ns_ * 2);
        return true;
      }
      cpu_relax();
    }
    if (Clock::now() >= stop) {
      spin_ns_ = std::max(kMinSpinNs, spin_ns_ / 2);
      return false;
    }
  }
}

void Sync::wait(const Signal& signal, uint32_t target, int peer, const OpContext& ctx) const {
  if (reached(signal.value.load(std::memory_order_acquire), target)) return;
  if (spin_ && spin_until(signal, target)) return;
  auto& s = const_cast<Signal&>(signal);
  auto next_check = Clock::now() + kSlice;
  while (true) {
    s.sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = s.value.load(std::memory_order_seq_cst);
    if (!reached(v, target)) futex_wait(s, v, kSlice);
    s.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(s.value.load(std::memory_order_acquire), target)) return;
    auto now = Clock::now();
    if (now >= ctx.deadline) {
      fail(ctx, peer, "timed out after " + std::to_string(ctx.timeout.count()) +
                          " ms waiting for rank " + std::to_string(peer));
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
