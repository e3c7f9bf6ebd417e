// ShmBackend: the c10d::Backend registered as "pycomm". It checks arguments, makes
// tensors contiguous, and queues each operation on one of three Executors (lanes):
// collectives, sends, receives. Each lane completes in issue order; sends and receives
// have their own so that two ranks may both send before they receive. The algorithms live
// in collectives.h. Operations it does not implement raise c10d's "does not support".
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/c10d.h"
#include "shm/collectives.h"
#include "shm/flight.h"
#include "shm/hooks.h"
#include "shm/work.h"

namespace pycomm::shm {

class ShmBackend : public c10d::Backend, public comm::BucketAllreduce {
 public:
  // Map segment `name` (rank 0 creates it); the caller unlinks it once all ranks mapped it.
  ShmBackend(const std::string& name, int rank, int size, std::chrono::milliseconds timeout,
             bool create);
  ~ShmBackend() override;

  const std::string getBackendName() const override { return "pycomm"; }

  // Note [Sequence numbers for torch's checks]
  // Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps every group's backend in a checker
  // that, before each collective, compares the operation, its tensors and the group's
  // sequence number across ranks over a Gloo helper group; making the wrapper calls
  // setSequenceNumberForGroup(), which c10d's default refuses. Here the number is the count
  // of collectives issued on the group (point-to-point operations not counted: ranks pair
  // up differently, and the wrapper does not check them), starting at 0 on every rank as
  // Gloo's does, so nothing needs agreeing at set time.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collectives_issued_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // A blocking all_reduce with no Work and no future: run on the calling thread when the
  // collectives' lane is idle, else queued behind what is there and waited for
  // (pycomm.shm.all_reduce; See Note [Inline all-reduce]).
  // `type`, not a ReduceOp: what dist.ReduceOp.SUM is in Python, passed with no conversion.
  void allreduce_inline(const at::Tensor& tensor, c10d::ReduceOp::RedOpType type);
  // An asynchronous sum all-reduce of `tensors` as one buffer (back to back, in list
  // order), each rank's elements multiplied by `scale` first, results written back in
  // place: a DDP bucket reduced where its gradients are (See Note [Pieces all-reduce]).
  // The same collective as all_reduce of one tensor of their total size. Dense (each one's
  // bytes taken in memory order), non-overlapping float32 or float64 CPU tensors of one dtype.
  c10::intrusive_ptr<c10d::Work> allreduce_pieces(std::vector<at::Tensor> tensors, double scale,
                                                  const comm::OpLabel& label) override;
  // A sum reduce-scatter of `tensors` as one buffer, scaled as allreduce_pieces scales, the
  // tensors only read: `out` gets this rank's range of the sum and the tail's (See
  // comm::BucketAllreduce and Note [Pieces reduce-scatter]).
  c10::intrusive_ptr<c10d::Work> reduce_scatter_pieces(std::vector<at::Tensor> tensors,
                                                       double scale, at::Tensor out,
                                                       const comm::OpLabel& label) override;
  // A sum all-reduce of `tensor`, as allreduce(), carrying the caller's label.
  c10::intrusive_ptr<c10d::Work> allreduce_sum(at::Tensor tensor,
                                               const comm::OpLabel& label) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  // The list forms FSDP2 issues under torch's coalescing manager, each one collective for
  // the whole list (See Note [Coalesced into-tensor collectives] in coalesced.h).
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  // outputs[r][i] gets rank r's inputs[i]: one all-gather for the whole list.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
#if PYCOMM_C10D_GATHER_SINGLE
  // gather into one tensor (dist.gather_single): the root's `output` holds every rank's
  // input, rank by rank; the ranks' bytes go straight into it (no list of per-rank tensors
  // to concatenate). Other ranks pass an empty tensor.
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input,
                                               const c10d::GatherOptions& opts) override;
#endif
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  // See Note [Receiving from any source] in p2p.cpp; the Work's sourceRank() names the peer.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Counters since the group was created: how operations ran and how their waits ended
  // (See Note [Adaptive spin] and Note [Waiting helps]); pycomm.shm.stats() documents them.
  std::map<std::string, int64_t> stats() const;
  // _reduce_scatter_base and _allgather_base under the name `op` (a string literal) in
  // errors and the flight record: the hierarchical all-reduce's phases name their wire.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_as(const char* op, at::Tensor& output,
                                                          at::Tensor& input,
                                                          const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> all_gather_tensor_as(const char* op, at::Tensor& output,
                                                      at::Tensor& input,
                                                      const c10d::AllgatherOptions& opts);
  // reduce_scatter_tensor_as of an input held in `pieces` (world x output.numel() elements
  // of `dtype`, float32 or float64, in order) pre-scaled by `scale`: the same collective,
  // so ranks may mix the two (Note [Pieces reduce-scatter] in collectives.cpp). The
  // pieces' memory must outlive the Work.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_pieces_as(const char* op, Pieces pieces,
                                                          c10::ScalarType dtype, double scale,
                                                          at::Tensor& output);
  // This rank's last operations on the group (See Note [Flight recorder] in flight.cpp).
  std::vector<FlightEntry> flight_record() const { return flight_.entries(); }
  // Write them as JSON to `path`.
  void dump_flight_record(const std::string& path) const;
  // The file name this rank's record gets in a directory (segment name and rank): every
  // rank of a group shares the stem, so a merge tool can tell groups apart.
  std::string flight_record_name() const;

#if PYCOMM_TORCH_AT_LEAST(2, 6)  // Backend::shutdown() appeared in torch 2.6
  void shutdown() override { stop(); }
#endif
#if PYCOMM_C10D_ABORT_HOOKS
  // Run at the group's first failure (ShmBackend::fail), before its flight record is written.
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override {
    hooks_->add_abort(id, std::move(hook));
  }
  void unregisterAbortHook(int64_t id) override { hooks_->remove_abort(id); }
#endif
#if PYCOMM_C10D_COMPLETION_HOOKS
  bool supportsAbortHooks() const override { return true; }
  // Run as each operation issued through torch completes successfully, by the thread that
  // ran it (ShmWork::complete).
  bool supportsCompletionHooks() const override { return true; }
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override {
    hooks_->add_completion(id, std::move(hook));
  }
  void unregisterCompletionHook(int64_t id) override { hooks_->remove_completion(id); }
#endif

 private:
  using Body = std::function<void(const OpContext&)>;
  using Lane = std::shared_ptr<Executor>;
  // Queue `body` as operation `op` on `lane`; its Work's result() and future hold `outputs`.
  // `blocking`: the caller waits on the Work at once (See Note [Waiting helps]). `label`:
  // the caller's (a DDP bucket's), in the OpContext and the flight record.
  // `source`: a receive from any source's cell for the peer it took from (the Work's).
  c10::intrusive_ptr<c10d::Work> enqueue(const char* op, c10d::OpType type,
                                         std::vector<at::Tensor> outputs, Body body,
                                         const Lane& lane, bool blocking = false,
                                         const comm::OpLabel& label = {},
                                         std::shared_ptr<std::atomic<int>> source = nullptr);
  template <typename Options>
  c10::intrusive_ptr<c10d::Work> enqueue(const char* op, c10d::OpType type,
                                         std::vector<at::Tensor> outputs, Body body,
                                         const Options& opts) {
    return enqueue(op, type, std::move(outputs), std::move(body), collectives_, is_blocking(opts));
  }
  template <typename Options>
  static bool is_blocking(const Options& opts) {
#if PYCOMM_TORCH_AT_LEAST(2, 8)  // the options' asyncOp appeared in torch 2.8
    return !opts.asyncOp;
#else
    return false;
#endif
  }
  void stop();
  void run(const char* op, uint64_t seq, const Body& body, const comm::OpLabel& label = {});
  // The group's first failure: remembered (every later operation fails with it) and the
  // flight record written where $PYCOMM_FLIGHT_RECORD_DIR says.
  void fail(const std::string& what);
  void allreduce_body(const at::Tensor& t, c10d::ReduceOp::RedOpType op, const OpContext& ctx);
  // Every rank's `ins`, packed rank by rank (block bytes each): the bytes of world blocks.
  at::Tensor gather_packed(const std::vector<at::Tensor>& ins, int64_t block, const OpContext& c);
  c10::intrusive_ptr<c10d::Work> gather_into(const char* op, std::vector<at::Tensor> outs,
                                             const at::Tensor& input,
                                             const c10d::AllgatherOptions& opts);

  std::string name_;  // the segment's
  std::shared_ptr<BackendHooks> hooks_ = std::make_shared<BackendHooks>();
  FlightRecorder flight_{kFlightEntries};
  std::unique_ptr<Channel> channel_;
  std::chrono::milliseconds timeout_;
  Lane collectives_, sends_, receives_;
  std::atomic<uint64_t> next_seq_{0};
  std::atomic<uint64_t> collectives_issued_{0};  // See Note [Sequence numbers for torch's checks]
  std::mutex failure_mutex_;
  std::string failure_;  // the first failed operation's error: the group is unusable after it
  std::atomic<bool> failed_{false};  // failure_ is set (read without the lock)
  std::thread aborting_;  // runs the abort hooks at the first failure (fail())
};

}  // namespace pycomm::shm
