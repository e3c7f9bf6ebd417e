// Argument checks and queueing of the operations of ShmBackend (see backend.h); gather,
// scatter and the list all_to_all are in backend_tensor_lists.cpp, the reducer's bucket
// all-reduces in backend_buckets.cpp.
#include "shm/backend.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"

namespace pycomm::shm {

namespace {

// Per round and rank (kSlotsPerRank slots per rank): the chunk of the pipelined all-reduce
// (Note [All-reduce paths]). Measured at 2 ranks, CPU time per all-reduce of 4-256 MiB,
// A/B interleaved in one run: 256 KiB chunks cost 2-7% more and 1 MiB chunks 0-8% more.
constexpr size_t kSlotBytes = 512 << 10;
constexpr size_t kMailboxBytes = 256 << 10;  // per ordered pair of ranks (send/recv)

// Byte offsets and lengths of the dim-0 blocks of `t` given split sizes (even if empty).
Split splits(const char* op, const at::Tensor& t, const std::vector<int64_t>& sizes, int world) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row_bytes = rows == 0 ? 0 : t.nbytes() / rows;
  std::vector<int64_t> counts = sizes;
  if (counts.empty()) {
    TORCH_CHECK_VALUE(rows % world == 0, "pycomm ", op, ": dim 0 (", rows,
                      ") does not split evenly over ", world, " ranks");
    counts.assign(world, rows / world);
  }
  TORCH_CHECK_VALUE(static_cast<int>(counts.size()) == world, "pycomm ", op, ": ", counts.size(),
                    " split sizes for ", world, " ranks");
  Split s;
  size_t off = 0;
  for (int64_t c : counts) {
    s.offset.push_back(off);
    s.bytes.push_back(c * row_bytes);
    off += c * row_bytes;
  }
  TORCH_CHECK_VALUE(off == t.nbytes(), "pycomm ", op, ": split sizes cover ", off, " bytes of a ",
                    t.nbytes(), "-byte tensor");
  return s;
}

}  // namespace

ShmBackend::ShmBackend(const std::string& name, int rank, int size,
                       std::chrono::milliseconds timeout, bool create)
    : c10d::Backend(rank, size), name_(name), timeout_(timeout) {
  auto segment = std::make_unique<Segment>(name, rank, size, kSlotBytes, kMailboxBytes, create);
  // Spinning pays only when every rank can have a core of its own.
  bool spin = static_cast<unsigned>(size) <= std::thread::hardware_concurrency();
  channel_ = std::make_unique<Channel>(std::move(segment), rank, spin);
  collectives_ = std::make_shared<Executor>();
  sends_ = std::make_shared<Executor>();
  receives_ = std::make_shared<Executor>();
  const bool on_signal = register_flight_dump(this, [this](const std::string& dir) {
    dump_flight_record(dir + "/" + flight_record_name());  // Note [Flight records on a signal]
  });
  channel_->set_dumps_on_signal(on_signal);  // Note [Every rank dumps]
}

ShmBackend::~ShmBackend() {
  unregister_flight_dump(this);
  stop();
}

std::map<std::string, int64_t> ShmBackend::stats() const {
  std::map<std::string, int64_t> out;
  auto add = [&](const char* key, uint64_t v) { out[key] += static_cast<int64_t>(v); };
  for (const auto& lane : {collectives_, sends_, receives_}) {
    LaneStats s = lane->stats();
    add("ops_on_caller_thread", s.on_caller);
    add("ops_on_worker_thread", s.on_worker);
    add("worker_idle_wakeups", s.idle_wakeups);
  }
  std::vector<WaitStats> waits = channel_->wait_stats();
  for (const auto& w : waits) {
    add("waits", w.waits);
    add("waits_spun", w.spun);
    add("waits_slept", w.slept);
    add("waits_spun_through_wakeup", w.transit);
  }
  out["spin_budget_ns"] = waits.front().spin_budget_ns;
  return out;
}

void ShmBackend::stop() {
  for (const auto& lane : {collectives_, sends_, receives_}) lane->shutdown();
  std::thread aborting;
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    aborting = std::move(aborting_);
  }
  if (aborting.joinable()) aborting.join();
}

c10::intrusive_ptr<c10d::Work> ShmBackend::enqueue(
    const char* op, c10d::OpType type, std::vector<at::Tensor> outputs, Body body, const Lane& lane,
    bool blocking, const comm::OpLabel& label, std::shared_ptr<std::atomic<int>> source) {
  int64_t bytes = 0;
  for (const auto& t : outputs) bytes += static_cast<int64_t>(t.nbytes());
  const c10::ScalarType dtype = outputs.empty() ? c10::ScalarType::Undefined
                                                : outputs.front().scalar_type();
  auto work = c10::make_intrusive<ShmWork>(rank_, type, std::move(outputs), lane);
  if (source != nullptr) work->set_source_cell(std::move(source));
#if PYCOMM_C10D_COMPLETION_HOOKS
  if (hooks_->any_completion()) work->set_hooks(hooks_);
#endif
  uint64_t seq = next_seq_++;
  if (type != c10d::OpType::SEND && type != c10d::OpType::RECV &&
      type != c10d::OpType::RECVANYSOURCE) {
    ++collectives_issued_;
  }
  flight_.queued(seq, op, bytes, dtype, label);
  // A blocking call on an idle lane runs here and returns its Work already completed: no
  // task is queued (See Note [Waiting helps]).
  if (blocking && lane->run_if_idle([&] {
        std::exception_ptr error;
        try {
          run(op, seq, body, label);
        } catch (...) {
          error = std::current_exception();
        }
        work->complete(error);
      })) {
    return work;
  }
  Executor::Body task = [this, op, seq, label, body = std::move(body)] {
    run(op, seq, body, label);
  };
  if (blocking) {
    lane->run_or_submit(work, std::move(task));
  } else {
    lane->submit(work, std::move(task));
  }
  return work;
}

void ShmBackend::run(const char* op, uint64_t seq, const Body& body, const comm::OpLabel& label) {
  OpContext ctx{op, seq, rank_, timeout_, Clock::now() + timeout_, !on_lane_worker(), label};
  flight_.started(seq);
  if (failed_.load(std::memory_order_acquire)) {
    std::string what;
    {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      what = "the group is unusable after an earlier failure: " + failure_;
    }
    flight_.ended(seq, what);
    throw_op_error(ctx, what);
  }
  try {
    body(ctx);
  } catch (const c10::Error& e) {
    flight_.ended(seq, e.what_without_backtrace());
    fail(e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    flight_.ended(seq, e.what());
    fail(e.what());
    throw;
  }
  flight_.ended(seq, "");
}

void ShmBackend::fail(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (!failure_.empty()) return;
    failure_ = what;
    failed_.store(true, std::memory_order_release);
  }
  const std::string dir = flight_record_dir();
  if (!dir.empty()) {
    try {
      dump_flight_record(dir + "/" + flight_record_name());
    } catch (const std::exception& e) {
      TORCH_WARN("pycomm: could not write the flight record into ", dir, ": ", e.what());
    }
    channel_->signal_peers_to_dump();  // Note [Every rank dumps]
  }
  // torch's abort hooks run beside the failing call, not before it raises: torch 2.15's
  // flight-recorder hook waits for its trace dump (TORCH_FR_WAIT_TIMEOUT_DUMP_MILSEC), which
  // made a dead rank's report 1.5 s late. The thread is joined when the backend stops.
  std::lock_guard<std::mutex> lock(failure_mutex_);
  aborting_ = std::thread([hooks = hooks_] { hooks->aborting(); });
}

std::string ShmBackend::flight_record_name() const {
  return c10::str(name_.substr(name_.rfind('/') + 1), "_rank", rank_, ".json");
}

void ShmBackend::dump_flight_record(const std::string& path) const {
  flight_.write(path, rank_, size_);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single("broadcast", tensors);
  int root = static_cast<int>(opts.rootRank);
  check_rank("broadcast", "root", root, size_);
  return enqueue(
      "broadcast", c10d::OpType::BROADCAST, {t},
      [this, t, root](const OpContext& c) {
        Dense d(t);
        channel_->broadcast(d.data(), d.bytes(), root, c);
        d.write_back();
      },
      opts);
}

void ShmBackend::allreduce_body(const at::Tensor& t, c10d::ReduceOp::RedOpType op,
                                const OpContext& ctx) {
  Dense d(t);
  channel_->allreduce(d.data(), d.work.numel(), t.scalar_type(), op, ctx);
  d.write_back();
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single("all_reduce", tensors);
  check_reduction("all_reduce", t.scalar_type(), opts.reduceOp);
  auto op = opts.reduceOp.op_;
  return enqueue(
      "all_reduce", c10d::OpType::ALLREDUCE, {t},
      [this, t, op](const OpContext& c) { allreduce_body(t, op, c); }, opts);
}

// Note [Inline all-reduce]
// What a blocking dist.all_reduce costs beyond the exchange (torch's Python wrapper, the
// dispatcher, a Work) is several times the exchange itself for small tensors (docs/collectives.md,
// "A small all-reduce, part by part"). pycomm.shm.all_reduce comes straight here: when the
// collectives' lane is idle the exchange runs on the calling thread with the lane held
// (Executor::run_if_idle), so operations other threads issue meanwhile queue behind it as
// behind any operation; it takes its sequence number from the same counter and obeys the
// same failure rule (ShmBackend::run). When the lane is not idle (asynchronous operations
// still queued or running), it goes through allreduce() and waits, keeping issue order.
void ShmBackend::allreduce_inline(const at::Tensor& tensor, c10d::ReduceOp::RedOpType type) {
  const c10d::ReduceOp op(type);
  check_dense("all_reduce", tensor);
  check_reduction("all_reduce", tensor.scalar_type(), op);
  const bool ran = collectives_->run_if_idle([&] {
    const uint64_t seq = next_seq_++;
    ++collectives_issued_;
    flight_.queued(seq, "all_reduce", static_cast<int64_t>(tensor.nbytes()), tensor.scalar_type(),
                   {});
    run("all_reduce", seq, [&](const OpContext& c) { allreduce_body(tensor, type, c); });
  });
  if (ran) return;
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
#if PYCOMM_TORCH_AT_LEAST(2, 8)
  opts.asyncOp = false;
#endif
  allreduce(tensors, opts)->wait();
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  for (const auto& t : tensors) {
    check_dense("all_reduce_coalesced", t);
    check_reduction("all_reduce_coalesced", t.scalar_type(), opts.reduceOp);
  }
  auto op = opts.reduceOp.op_;
  return enqueue(
      "all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors,
      [this, tensors, op](const OpContext& c) {
        // See Note [Coalesced all-reduce] in tensor_args.h
        reduce_coalesced(tensors, [&](const at::Tensor& flat) {
          channel_->allreduce(static_cast<char*>(flat.data_ptr()), flat.numel(), flat.scalar_type(),
                              op, c);
        });
      },
      opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single("reduce", tensors);
  check_reduction("reduce", t.scalar_type(), opts.reduceOp);
  int root = static_cast<int>(opts.rootRank);
  check_rank("reduce", "root", root, size_);
  auto op = opts.reduceOp.op_;
  return enqueue(
      "reduce", c10d::OpType::REDUCE, {t},
      [this, t, op, root](const OpContext& c) {
        Dense d(t);
        channel_->reduce(d.data(), d.work.numel(), t.scalar_type(), op, root, c);
        d.write_back();
      },
      opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::gather_into(const char* op, std::vector<at::Tensor> outs,
                                                       const at::Tensor& input,
                                                       const c10d::AllgatherOptions& opts) {
  return enqueue(
      op, c10d::OpType::ALLGATHER, outs,
      [this, outs, input](const OpContext& c) {
        Dense in(input);
        DenseList dense(outs);
        channel_->allgather(in.data(), in.bytes(), dense.ptrs, c);
        dense.write_back();
      },
      opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single("all_gather", inputs);
  TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                    "pycomm all_gather: expects one list of ", size_, " output tensors");
  for (const auto& o : outputs[0]) check_like("all_gather", o, in, in.numel());
  return gather_into("all_gather", outputs[0], in, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  return all_gather_tensor_as("all_gather_into_tensor", output, input, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::all_gather_tensor_as(
    const char* op, at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  check_dense(op, input);
  check_like(op, output, input, input.numel() * size_);
  TORCH_CHECK_VALUE(output.is_contiguous(), "pycomm ", op,
                    ": the output tensor must be contiguous");
  at::Tensor flat = output.reshape({-1});
  std::vector<at::Tensor> blocks;
  for (int r = 0; r < size_; ++r)
    blocks.push_back(flat.narrow(0, r * input.numel(), input.numel()));
  return gather_into(op, blocks, input, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single("reduce_scatter", outputs);
  TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                    "pycomm reduce_scatter: expects one list of ", size_, " input tensors");
  // Note [Uneven reduce-scatter]
  // Each rank's output may have its own size, as Gloo allows: inputs[j] is rank j's piece,
  // of rank j's output size, the same sizes on every rank. Uneven pieces are laid out at
  // the largest piece's stride, zero-padded, and reduce-scattered at that count; each rank
  // keeps its piece's part. The padding is reduced with padding only, so any op is exact.
  int64_t widest = 0;
  for (size_t j = 0; j < inputs[0].size(); ++j) {
    const at::Tensor& i = inputs[0][j];
    check_dense("reduce_scatter", i);
    TORCH_CHECK_VALUE(i.scalar_type() == out.scalar_type(), "pycomm reduce_scatter: input ", j,
                      " is ", i.scalar_type(), " but the output is ", out.scalar_type());
    widest = std::max(widest, i.numel());
  }
  check_like("reduce_scatter", inputs[0][rank_], out, out.numel());
  check_reduction("reduce_scatter", out.scalar_type(), opts.reduceOp);
  auto op = opts.reduceOp.op_;
  auto ins = inputs[0];
  return enqueue(
      "reduce_scatter", c10d::OpType::REDUCE_SCATTER, {out},
      [this, out, ins, op, widest](const OpContext& c) {
        const bool even = std::all_of(ins.begin(), ins.end(),
                                      [&](const at::Tensor& i) { return i.numel() == widest; });
        at::Tensor in;
        if (even) {
          std::vector<at::Tensor> flat;
          for (const auto& i : ins) flat.push_back(i.reshape({-1}));
          in = at::cat(flat);
        } else {  // See Note [Uneven reduce-scatter]
          in = at::zeros({widest * size_}, out.options());
          for (int j = 0; j < size_; ++j)
            in.narrow(0, j * widest, ins[j].numel()).copy_(ins[j].reshape({-1}));
        }
        at::Tensor mine = even ? out : at::empty({widest}, out.options());
        Dense d(mine);
        // Gloo reduces each rank's output as a buffer of its own (Note [Gloo's summation
        // order]); the padding, past the output, takes any order.
        channel_->reduce_scatter(static_cast<char*>(in.data_ptr()), d.data(), widest,
                                 out.scalar_type(), op,
                                 SumOrder().then(widest, out.numel(), 0, GlooRing::kAllreduce), c);
        d.write_back();
        if (!even) out.copy_(mine.narrow(0, 0, out.numel()).view(out.sizes()));
      },
      opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_tensor_as("reduce_scatter_tensor", output, input, opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce_scatter_tensor_as(
    const char* name, at::Tensor& output, at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  check_dense(name, output);
  check_like(name, input, output, output.numel() * size_);
  check_reduction(name, output.scalar_type(), opts.reduceOp);
  auto op = opts.reduceOp.op_;
  return enqueue(
      name, c10d::OpType::_REDUCE_SCATTER_BASE, {output},
      [this, output, input, op](const OpContext& c) {
        Dense in(input), out(output);
        channel_->reduce_scatter(in.data(), out.data(), output.numel(), output.scalar_type(), op,
                                 SumOrder::scattered(size_, rank_, output.numel()), c);
        out.write_back();
      },
      opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_splits,
                                                         std::vector<int64_t>& input_splits,
                                                         const c10d::AllToAllOptions& opts) {
  check_dense("all_to_all_single", input);
  check_dense("all_to_all_single", output);
  TORCH_CHECK_VALUE(input.scalar_type() == output.scalar_type(),
                    "pycomm all_to_all_single: input is ", input.scalar_type(), ", output is ",
                    output.scalar_type());
  Split send = splits("all_to_all_single", input, input_splits, size_);
  Split recv = splits("all_to_all_single", output, output_splits, size_);
  return enqueue(
      "all_to_all_single", c10d::OpType::ALLTOALL_BASE, {output},
      [this, output, input, send, recv](const OpContext& c) {
        Dense in(input), out(output);
        channel_->alltoall(in.data(), send, out.data(), recv, c);
        out.write_back();
      },
      opts);
}

// Messages between two ranks match in issue order; `tag` is not used for matching.
c10::intrusive_ptr<c10d::Work> ShmBackend::send(std::vector<at::Tensor>& tensors, int dst,
                                                int /*tag*/) {
  const at::Tensor& t = single("send", tensors);
  check_rank("send", "destination rank", dst, size_);
  TORCH_CHECK_VALUE(dst != rank_, "pycomm send: rank ", rank_, " cannot send to itself");
  return enqueue(
      "send", c10d::OpType::SEND, {t},
      [this, t, dst](const OpContext& c) {
        Dense d(t);
        channel_->send(d.data(), d.bytes(), dst, c);
      },
      sends_);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::recv(std::vector<at::Tensor>& tensors, int src,
                                                int /*tag*/) {
  const at::Tensor& t = single("recv", tensors);
  check_rank("recv", "source rank", src, size_);
  TORCH_CHECK_VALUE(src != rank_, "pycomm recv: rank ", rank_, " cannot receive from itself");
  return enqueue(
      "recv", c10d::OpType::RECV, {t},
      [this, t, src](const OpContext& c) {
        Dense d(t);
        channel_->recv(d.data(), d.bytes(), src, c);
        d.write_back();
      },
      receives_);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                         int /*tag*/) {
  const at::Tensor& t = single("recv (any source)", tensors);
  auto source = std::make_shared<std::atomic<int>>(-1);
  return enqueue(
      "recv_anysource", c10d::OpType::RECVANYSOURCE, {t},
      [this, t, source](const OpContext& c) {
        Dense d(t);
        source->store(channel_->recv_any(d.data(), d.bytes(), c), std::memory_order_release);
        d.write_back();
      },
      receives_, /*blocking=*/false, /*label=*/{}, source);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(
      "barrier", c10d::OpType::BARRIER, {}, [this](const OpContext& c) { channel_->barrier(c); },
      opts);
}

}  // namespace pycomm::shm
