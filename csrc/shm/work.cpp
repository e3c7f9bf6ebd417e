// ShmWork and Executor (see work.h).
#include "shm/work.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace pycomm::shm {

namespace {

thread_local bool t_lane_worker = false;

const c10::TypePtr& tensor_list_type() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

}  // namespace

bool on_lane_worker() { return t_lane_worker; }

ShmWork::ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                 std::shared_ptr<Executor> executor)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), executor_(std::move(executor)) {}

int ShmWork::sourceRank() const {
  TORCH_CHECK(source_ != nullptr,
              "pycomm: sourceRank() is known only for a receive from any source");
  return source_->load(std::memory_order_acquire);
}

bool ShmWork::wait(std::chrono::milliseconds timeout) {
  executor_->help(this);
  return c10d::Work::wait(timeout);
}

// Note [Lazy future]
// Most Works are waited on and dropped (every blocking dist.* call); only
// get_future() users need the future. Making it up front and completing it costs every
// operation two allocations (the future, the list of outputs) and a completion nobody
// watches (with the pre-completed Work of Note [Waiting helps], backend.allreduce().wait()
// of 4 bytes went from 2.2-2.3 to 1.8-2.0 us, separate runs on this 2-core VM). So the
// future is made on first request: by complete()'s thread if it was requested before the
// operation ended, else by getFuture() itself, already completed. `done_` under
// `future_mutex_` decides which of the two settles it; settling happens outside the lock
// because a future's callbacks run inline and may call getFuture() again.
c10::intrusive_ptr<c10::ivalue::Future> ShmWork::getFuture() {
  std::unique_lock<std::mutex> lock(future_mutex_);
  if (future_) return future_;
  future_ = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type());
  auto future = future_;
  if (done_) {
    lock.unlock();
    settle(*future, outputs_, error_);
  }
  return future;
}

void ShmWork::settle(c10::ivalue::Future& future, const std::vector<at::Tensor>& outputs,
                     const std::exception_ptr& error) {
  if (error) {
    future.setError(error);
  } else {
    future.markCompleted(c10::IValue(outputs));
  }
}

void ShmWork::complete(std::exception_ptr error) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mutex_);
    done_ = true;
    error_ = error;
    future = future_;
  }
  // The future first: once wait() returns, the future's callbacks have run.
  if (future) settle(*future, outputs_, error);
  finish(error);
#if PYCOMM_C10D_COMPLETION_HOOKS
  if (hooks_ && !error) hooks_->completed(getCompletionKey());
#endif
}

Executor::Executor() : thread_([this] { loop(); }) {}

Executor::~Executor() { shutdown(); }

void Executor::submit(c10::intrusive_ptr<ShmWork> work, Body body) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stop_, "pycomm shm: the process group has been shut down");
    queue_.push_back(Task{std::move(work), std::move(body)});
  }
  cv_.notify_one();
}

void Executor::run_or_submit(c10::intrusive_ptr<ShmWork> work, Body body) {
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(!stop_, "pycomm shm: the process group has been shut down");
  bool idle = !busy_ && queue_.empty();
  queue_.push_back(Task{std::move(work), std::move(body)});
  if (idle) run_front(lock);
  bool more = !busy_ && !queue_.empty();
  lock.unlock();
  if (more) cv_.notify_one();  // not idle, or queued by another thread meanwhile
}

void Executor::run(Task& task) {
  std::exception_ptr error;
  try {
    task.body();
  } catch (...) {
    error = std::current_exception();
  }
  task.work->complete(error);
}

// Pops the front task and runs it with the lock released; `busy_` covers the run.
c10::intrusive_ptr<ShmWork> Executor::run_front(std::unique_lock<std::mutex>& lock) {
  Task task = std::move(queue_.front());
  queue_.pop_front();
  busy_ = true;
  (t_lane_worker ? on_worker_ : on_caller_).fetch_add(1, std::memory_order_relaxed);
  lock.unlock();
  run(task);
  lock.lock();
  busy_ = false;
  return task.work;
}

void Executor::help(const ShmWork* work) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!busy_ && !queue_.empty()) {
    auto mine = std::find_if(queue_.begin(), queue_.end(),
                             [&](const Task& t) { return t.work.get() == work; });
    if (mine == queue_.end()) return;  // already run, or running on the worker
    if (run_front(lock).get() == work) break;
  }
  // Hand what is left to the worker; never wake it for nothing: a waiter calls help() on
  // every blocking operation, and a needless wake-up of the worker preempts the peer rank
  // on a busy machine (it cost a context switch per all-reduce).
  bool more = !busy_ && !queue_.empty();
  lock.unlock();
  if (more) cv_.notify_one();
}

void Executor::loop() {
  t_lane_worker = true;
  std::unique_lock<std::mutex> lock(mutex_);
  auto ready = [&] { return stop_ || (!busy_ && !queue_.empty()); };
  while (true) {
    while (!ready()) {
      cv_.wait(lock);
      if (!ready()) idle_wakeups_.fetch_add(1, std::memory_order_relaxed);
    }
    if (stop_) return;
    run_front(lock);
  }
}

LaneStats Executor::stats() const {
  return LaneStats{on_caller_.load(std::memory_order_relaxed),
                   on_worker_.load(std::memory_order_relaxed),
                   idle_wakeups_.load(std::memory_order_relaxed)};
}

void Executor::shutdown() {
  std::deque<Task> orphans;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return;
    stop_ = true;
    orphans.swap(queue_);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& task : orphans) {
    task.work->complete(std::make_exception_ptr(
        c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              "pycomm shm: the process group was shut down before this "
                              "operation ran")));
  }
}

}  // namespace pycomm::shm
