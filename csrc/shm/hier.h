// HierBackend: the "pycomm" backend of a group whose ranks sit on several hosts, each host
// holding the same number of them. It composes three groups that pycomm/shm.py builds
// from the one store torch hands the creator:
//   local  the ranks of this host, over shared memory (a ShmBackend)
//   cross  the ranks of every host with this rank's local index, one per host (Gloo)
//   flat   every rank of the group (Gloo), for the operations other than all-reduce and
//          the tensor forms of reduce-scatter and all-gather (single or coalesced)
//
// Note [Hierarchical all-reduce]
// H hosts of L ranks each, S bytes to all-reduce. The buffer is cut into L shards (the
// last one padded when L does not divide it); local rank i owns shard i.
//
//   host 0  r0 [a0|b0]  r1 [a1|b1]      1. reduce-scatter within the host (shared memory):
//   host 1  r2 [a2|b2]  r3 [a3|b3]         r0 holds a0+a1, r1 b0+b1, r2 a2+a3, r3 b2+b3
//                                       2. all-reduce of each shard across hosts (Gloo),
//                                          r0 with r2, r1 with r3: a = (a0+a1)+(a2+a3)
//                                       3. all-gather within the host (shared memory)
//
// What leaves a host: its L ranks each all-reduce S/L bytes over a ring of H ranks, so
// 2(H-1)/H x S in all, against 2(n-1)/n x S over each boundary link of a flat ring of
// n = H x L ranks; and 2(H-1) steps over the slow link instead of 2(n-1). Inside a host the
// traffic moves through shared memory instead of TCP loopback.
// Order of the sum: every element is (sum over its host's ranks, in the shared-memory
// order, Note [Gloo's summation order]) summed over hosts in Gloo's order, the same on every
// rank, so all ranks get identical bits; a flat Gloo all-reduce adds in another order, so
// the two differ by float rounding only. AVG sums throughout and divides once at the end.
// With one rank per host (L = 1) steps 1 and 3 have nothing to combine and are skipped,
// here and in the tensor forms below (Note [One rank per host] in hier_allreduce.cpp).
//
// Note [Hierarchical pipeline]
// Run one after the other, the three phases leave the slow link idle while the host
// reduces and gathers. So the buffer is cut into blocks of L pieces (2 MiB each, the
// last block shorter: 2 MiB crosses a 1 Gbit/s link in 17 ms, and a host's reduce-scatter
// of its block takes about 1 ms; HierBackend.piece_bytes sets it) and the phases are
// pipelined over the blocks: block b's pieces
// cross hosts (Gloo, on its own threads) while this thread reduce-scatters block b+1 and
// then gathers block b once it is back.
//
//   thread  [RS 0][RS 1][wait 0][AG 0][RS 2][wait 1][AG 1] ... [wait B-1][AG B-1]
//   Gloo          [across 0    ][across 1         ][across 2 ...]
//
// Rank i of a host owns piece i of every block. The order of the steps depends only on
// the tensor's size and L, so every rank of a host takes the same shared-memory rounds in
// the same order and every cross-host group the same Gloo collectives.
//
// Note [Hierarchical reduce-scatter and all-gather]
// The tensor forms (reduce_scatter_tensor, all_gather_into_tensor: what a sharded
// optimizer runs per bucket) keep the flat group's layout, rank r's range at r x s, and
// move across hosts only what must cross: (H-1)/H of the tensor out of each host, where
// the flat Gloo ring sends (n-1)/n of it over each boundary link (reduce-scatter: Gloo's
// is one all-reduce per rank). With ranks[h][l] the group rank of host h's local rank l:
//
//   reduce-scatter  1. copy the input into L chunks of H ranges, chunk l holding the
//                      ranges of ranks[0][l], ..., ranks[H-1][l], in host order
//                   2. reduce-scatter the chunks within the host (shared memory): local
//                      rank l holds chunk l summed over its host
//                   3. all-to-all of chunk l across hosts (Gloo, the cross group): each
//                      rank receives its own range from every host, and adds the H of
//                      them in host order
//   all-gather      the same backwards: all-gather the rank's range across hosts into
//                   chunk l, all-gather the chunks within the host, copy the ranges home.
//
// Both run as pipelines over blocks, as the all-reduce does (Note [Hierarchical
// pipeline]): block j is elements [j x c, (j + 1) x c) of every rank's range, c = one
// piece. Reduce-scatter: block j's copy and reduce-scatter within the host run while block
// j-1 crosses hosts; block j-1's H ranges are summed once back. All-gather: block j+1
// crosses hosts while block j is all-gathered within the host and copied home. Unpipelined,
// each phase left the other idle: on 2 x 2 namespaced hosts at 1 Gbit/s a 33.6 MB bucket
// took about 250 ms each way, for 17 MB per host on a link that carries it in 134 ms.
//
// Bytes across hosts, both together: 2(H-1)/H x S per host, what one hierarchical
// all-reduce sends. The copies in and out of the chunk order stay in the host's memory.
// Sums: each element is (its host's ranks, in the shared-memory order) then hosts in order;
// AVG sums both stages and divides once.
//
// Note [A group's wire]
// A group made with pycomm.shm.Options(wire="bf16" or "int8") sends its reduce-scatters'
// cross-host all-to-all in that wire, as reduce_scatter_wire does for a sharded DDP's
// buckets (Note [Low-precision wire] in wire_codec.h): each host's sums of a rank's range
// cross once, encoded, and the rank adds the H of them in float32; AVG divides that float32
// sum by the group's size before it is written in the output's dtype. This is how FSDP2's
// gradient reduce-scatters (single, or coalesced) get the wire without FSDP2 knowing. It is
// decided when the group is made and applies to SUM and AVG of float32, bfloat16 and
// float16 tensors; everything else (float64 and integer reduce-scatters, other
// reductions, and every all-reduce and all-gather, which carry norms, losses and
// parameters) crosses as it is. No error feedback: a group's collectives have no tensor to
// keep a residual for from one call to the next.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/wire.h"
#include "shm/backend.h"
#include "shm/work.h"

namespace pycomm::shm {

class HierBackend : public c10d::Backend, public comm::WireCollectives {
 public:
  // ranks[h][l]: the group rank of host h's local rank l (host_ is this rank's h).
  // `wire`: what the group's reduce-scatters send across hosts (pycomm.shm.Options.wire;
  // Note [A group's wire]).
  HierBackend(int rank, int size, int host, std::vector<std::vector<int>> ranks,
              c10::intrusive_ptr<ShmBackend> local, c10::intrusive_ptr<c10d::Backend> cross,
              c10::intrusive_ptr<c10d::Backend> flat, comm::Wire wire = {});
  ~HierBackend() override;
#if PYCOMM_TORCH_AT_LEAST(2, 6)  // Backend::shutdown() appeared in torch 2.6
  // Fail what is queued on the lane once its running operation ends, then shut the three
  // groups down (destroy_process_group calls it).
  void shutdown() override;
#endif

  const std::string getBackendName() const override { return "pycomm"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  // A sum all-reduce whose cross-host leg carries `wire` (Note [Low-precision wire] in
  // wire_codec.h): float32, bfloat16 and float16 tensors.
  comm::WorkPtr allreduce_wire(at::Tensor tensor, const comm::Wire& wire,
                               std::shared_ptr<comm::WireResidual> residual) override;
  // The all-reduce of pieces of one buffer (a DDP bucket's gradients in slot order) scaled
  // by `scale`, the sums written back into them, its cross-host leg in `wire` (Note
  // [Hierarchical all-reduce of pieces] in hier_allreduce.cpp): float32 and float64 pieces
  // on the float32 wire, float32 on the others.
  comm::WorkPtr allreduce_pieces_wire(std::vector<at::Tensor> tensors, double scale,
                                      const comm::Wire& wire,
                                      std::shared_ptr<comm::WireResidual> residual) override;
  // A sum reduce_scatter_tensor whose cross-host all-to-all carries `wire`: each host's
  // sums of the rank's range cross once, encoded, and the rank adds the H of them in
  // float32 (Note [Low-precision wire]); float32, bfloat16 and float16 tensors.
  comm::WorkPtr reduce_scatter_wire(at::Tensor output, at::Tensor input, const comm::Wire& wire,
                                    std::shared_ptr<comm::WireResidual> residual) override;

  // Everything else goes to the flat group.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return flat_->broadcast(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    return flat_->reduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return flat_->allgather(outputs, inputs, opts);
  }
  // See Note [Hierarchical reduce-scatter and all-gather].
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return flat_->reduce_scatter(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  // The list forms torch's coalescing manager issues (FSDP2's), each one pipeline over the
  // entries packed rank by rank (Note [Coalesced into-tensor collectives] in coalesced.h).
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return flat_->gather(outputs, inputs, opts);
  }
#if PYCOMM_C10D_GATHER_SINGLE
  // The flat group's gather, into views of the root's output.
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input,
                                               const c10d::GatherOptions& opts) override;
#endif
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return flat_->scatter(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return flat_->alltoall(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    return flat_->alltoall_base(output, input, output_splits, input_splits, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return flat_->send(tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return flat_->recv(tensors, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return flat_->recvAnysource(tensors, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return flat_->barrier(opts);
  }

  // What the group's reduce-scatters send across hosts (Note [A group's wire]).
  const comm::Wire& wire() const { return wire_; }
  // A ValueError unless `wire` can be a group's: no error feedback.
  static void check_group_wire(const comm::Wire& wire);
  int host() const { return host_; }
  int hosts() const { return hosts_; }
  const c10::intrusive_ptr<ShmBackend>& local() const { return local_; }
  // The pipelines' piece (See Note [Hierarchical pipeline]): what crosses hosts per step
  // of a pipeline, per rank. Every rank of the group must use the same: it sets the
  // schedule. Operations issued later use it.
  static constexpr int64_t kDefaultPieceBytes = 2 << 20;
  int64_t piece_bytes() const { return piece_bytes_; }
  void set_piece_bytes(int64_t bytes);

 private:
  // Run body(seq) on the lane, behind every operation issued before; the first failure
  // makes the group unusable (later operations fail naming it).
  c10::intrusive_ptr<c10d::Work> enqueue(const char* op, c10d::OpType type,
                                         std::vector<at::Tensor> outputs,
                                         std::function<void(uint64_t seq)> body);
  // One all-reduce, the three phases of Note [Hierarchical all-reduce], on the lane.
  // With a low-precision `wire`, its cross-host leg as Note [Low-precision wire] says.
  void run(const char* op, uint64_t seq, int64_t piece_bytes, const at::Tensor& t,
           c10d::ReduceOp::RedOpType reduce, comm::Wire wire = {},
           comm::WireResidual* residual = nullptr);
  // Note [Hierarchical reduce-scatter and all-gather], on the lane. With a low-precision
  // `wire` (a sum), its all-to-all as Note [Low-precision wire] says.
  void reduce_scatter_tensor(uint64_t seq, int64_t piece_bytes, const at::Tensor& output,
                             const at::Tensor& input, c10d::ReduceOp::RedOpType reduce,
                             comm::Wire wire = {}, comm::WireResidual* residual = nullptr);
  void all_gather_tensor(uint64_t seq, int64_t piece_bytes, const at::Tensor& output,
                         const at::Tensor& input);
  // Copy between the group's layout (rank r's range at r x s) and the chunk order of one
  // block, elements [begin, begin + len) of every rank's range (local rank l's chunk holds
  // those of ranks[0][l], ..., ranks[H-1][l]); `to_chunks` says which way.
  void permute(const at::Tensor& group_order, const at::Tensor& chunk_order, int64_t s,
               int64_t begin, int64_t len, bool to_chunks) const;

  // The wire a reduce-scatter of `dtype` with `reduce` crosses hosts in: the group's where
  // it carries it (a SUM or AVG of float32, bfloat16 or float16), else fp32.
  comm::Wire reduce_scatter_wire_for(at::ScalarType dtype, c10d::ReduceOp::RedOpType reduce) const;

  int host_, hosts_;
  std::vector<std::vector<int>> ranks_;
  const comm::Wire wire_;
  c10::intrusive_ptr<ShmBackend> local_;
  c10::intrusive_ptr<c10d::Backend> cross_, flat_;
  std::shared_ptr<Executor> lane_;
  int64_t piece_bytes_ = kDefaultPieceBytes;
  uint64_t next_seq_ = 0;  // issue order; issuing threads are serialized by c10d callers
  std::mutex failure_mutex_;
  std::string failure_;  // the first failed all-reduce: the group is unusable after it
};

}  // namespace pycomm::shm
