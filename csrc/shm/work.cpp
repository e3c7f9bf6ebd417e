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
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      executor_(std::move(executor)),
      future_(c10::make_intrusive<c10::ivalue::Future>(tensor_list_type())) {}

bool ShmWork::wait(std::chrono::milliseconds timeout) {
  executor_->help(this);
  return c10d::Work::wait(timeout);
}

c10::intrusive_ptr<c10::ivalue::Future> ShmWork::getFuture() { return future_; }

void ShmWork::complete(std::exception_ptr error) {
  // The future first: once wait() returns, the future's callbacks have run.
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(error);
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
