// The hooks torch registers on a ShmBackend (c10d's Hooks.hpp), by torch's hook id: abort
// hooks, run at the group's first failure. Which torch has them: comm/c10d.h. Hooks run
// outside the lock that guards their table, so a hook may register or remove hooks.
#pragma once

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

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, std::function<void()>> abort_;
};

}  // namespace pycomm::shm
