// The hooks torch registers on a ShmBackend (c10d's Hooks.hpp), by torch's hook id: abort
// hooks, run at the group's first failure, and completion hooks, run as each operation
// completes successfully. Which torch has which: comm/c10d.h. Hooks run outside the lock
// that guards their table, so a hook may register or remove hooks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

#include "comm/c10d.h"

namespace pycomm::shm {

class BackendHooks {
 public:
  // Registering an id again replaces its hook; removing an unknown id does nothing.
  void add_abort(int64_t id, std::function<void()> hook);
  void remove_abort(int64_t id);
  // Run every abort hook (the group is about to fail for good).
  void aborting() const;
#if PYCOMM_C10D_COMPLETION_HOOKS
  void add_completion(int64_t id, c10d::CompletionHook hook);
  void remove_completion(int64_t id);
  bool any_completion() const { return any_completion_.load(std::memory_order_acquire); }
  // Run every completion hook for the operation whose Work has completion key `key`.
  void completed(uint64_t key) const;
#endif

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, std::function<void()>> abort_;
#if PYCOMM_C10D_COMPLETION_HOOKS
  std::map<int64_t, c10d::CompletionHook> completion_;
  std::atomic<bool> any_completion_{false};
#endif
};

}  // namespace pycomm::shm
