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

#if PYCOMM_C10D_COMPLETION_HOOKS
void BackendHooks::add_completion(int64_t id, c10d::CompletionHook hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  completion_[id] = std::move(hook);
  any_completion_.store(true, std::memory_order_release);
}

void BackendHooks::remove_completion(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  completion_.erase(id);
  any_completion_.store(!completion_.empty(), std::memory_order_release);
}

void BackendHooks::completed(uint64_t key) const {
  std::map<int64_t, c10d::CompletionHook> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    hooks = completion_;
  }
  // No duration: the backend does not time its operations for torch (its flight record
  // has the times).
  const c10d::CompletionHookArgs args{key, std::nullopt};
  for (const auto& [id, hook] : hooks) run_hook("completion", id, hook, args);
}
#endif

}  // namespace pycomm::shm
