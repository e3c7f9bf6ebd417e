// BackendHooks (see hooks.h).
#include "shm/hooks.h"

#include <c10/util/Exception.h>

#include <exception>
#include <utility>

namespace pycomm::shm {

namespace {

// A hook that throws is reported and does not change what the operation did.
template <typename Hook, typename... Args>
void run_hook(const char* kind, int64_t id, const Hook& hook, const Args&... args) {
  try {
    hook(args...);
  } catch (const std::exception& e) {
    TORCH_WARN("pycomm: ", kind, " hook ", id, " raised: ", e.what());
  }
}

}  // namespace

void BackendHooks::add_abort(int64_t id, std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_[id] = std::move(hook);
}

void BackendHooks::remove_abort(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_.erase(id);
}

void BackendHooks::aborting() const {
  std::map<int64_t, std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    hooks = abort_;
  }
  for (const auto& [id, hook] : hooks) run_hook("abort", id, hook);
}

}  // namespace pycomm::shm
