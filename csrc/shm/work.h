// The Work objects of the shared-memory backend and the Executor: one worker thread (a
// lane) running its operations in issue order.
//
// Note [Waiting helps]
// A thread that waits on a Work whose operation has not started yet, while the worker is
// idle, runs the queued operations itself (in order, one at a time, as the worker would).
// A blocking collective thus costs no thread hand-off, while asynchronous ones still
// progress on the worker without anybody waiting. A call that torch marks blocking
// (asyncOp false in its options: the caller waits on the Work right after) goes further:
// when the lane is idle it runs at once on the calling thread, which gets its Work back
// completed (Executor::run_if_idle; else Executor::run_or_submit, which runs it here if
// the lane has become idle) and the worker is not even woken: no wake-up of a thread that
// would find nothing to do, which on a busy 2-core machine preempts the peer rank.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/c10d.h"
#include "shm/hooks.h"

namespace pycomm::shm {

class Executor;

// True on a lane's worker thread, false on any thread that runs an operation itself.
bool on_lane_worker();

class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
          std::shared_ptr<Executor> executor);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // Made on first request (See Note [Lazy future]).
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  // A receive from any source: the rank it took the message from, once complete (-1
  // before; the cell is filled by the operation's body).
  int sourceRank() const override;
  void set_source_cell(std::shared_ptr<std::atomic<int>> cell) { source_ = std::move(cell); }

  // Called once, by whichever thread ran the operation.
  void complete(std::exception_ptr error);
#if PYCOMM_C10D_COMPLETION_HOOKS
  // Report a successful completion to `hooks` once the Work reads completed (torch's
  // flight recorder asks isCompleted() when the hook has not come yet). Before it is queued.
  void set_hooks(std::shared_ptr<const BackendHooks> hooks) { hooks_ = std::move(hooks); }
#endif

 private:
  static void settle(c10::ivalue::Future& future, const std::vector<at::Tensor>& outputs,
                     const std::exception_ptr& error);

  std::vector<at::Tensor> outputs_;
  std::shared_ptr<Executor> executor_;
  std::shared_ptr<std::atomic<int>> source_;
#if PYCOMM_C10D_COMPLETION_HOOKS
  std::shared_ptr<const BackendHooks> hooks_;
#endif
  std::mutex future_mutex_;  // guards the three below
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool done_ = false;
  std::exception_ptr error_;
};

// How a lane's operations ran (see ShmBackend::stats).
struct LaneStats {
  uint64_t on_caller = 0;     // run by the thread that issued or waited on them
  uint64_t on_worker = 0;     // run by the lane's worker thread
  uint64_t idle_wakeups = 0;  // the worker woke and found nothing to run
};

// A FIFO of operations run one at a time: by the worker thread, or by a waiter
// (see Note [Waiting helps]).
class Executor {
 public:
  using Body = std::function<void()>;
  Executor();
  ~Executor();
  void submit(c10::intrusive_ptr<ShmWork> work, Body body);
  // Run `body` on this thread now when the lane is idle, else submit it (See Note
  // [Waiting helps]).
  void run_or_submit(c10::intrusive_ptr<ShmWork> work, Body body);
  // Run `fn` on this thread now, with no Work, when the lane is idle (nothing running or
  // queued) and return true; else return false without running it. The lane counts as
  // busy meanwhile, so operations issued by other threads queue behind it.
  template <typename F>
  bool run_if_idle(F&& fn);
  // Run queued operations on this thread while the worker is idle, until `work` has run
  // or is running elsewhere.
  void help(const ShmWork* work);
  // Fail the operations still queued and stop the worker.
  void shutdown();
  LaneStats stats() const;

 private:
  struct Task {
    c10::intrusive_ptr<ShmWork> work;
    Body body;
  };
  void loop();
  c10::intrusive_ptr<ShmWork> run_front(std::unique_lock<std::mutex>& lock);
  static void run(Task& task);

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::atomic<uint64_t> on_caller_{0}, on_worker_{0}, idle_wakeups_{0};
  std::thread thread_;
};

template <typename F>
bool Executor::run_if_idle(F&& fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stop_, "pycomm shm: the process group has been shut down");
    if (busy_ || !queue_.empty()) return false;
    busy_ = true;
  }
  on_caller_.fetch_add(1, std::memory_order_relaxed);
  // Release the lane whatever `fn` does, and hand on what others queued meanwhile.
  struct Release {
    Executor& e;
    ~Release() {
      std::unique_lock<std::mutex> lock(e.mutex_);
      e.busy_ = false;
      bool more = !e.queue_.empty();
      lock.unlock();
      if (more) e.cv_.notify_one();
    }
  } release{*this};
  fn();
  return true;
}

}  // namespace pycomm::shm
