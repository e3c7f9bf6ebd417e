// The shared-memory algorithms of one group, on raw contiguous buffers: rounds over
// fixed-size slots for collectives, per-pair mailboxes for send/recv. Tensors, dtypes
// checks and threads stop at backend.h; the arithmetic is in reduce_kernels.h.
//
// Note [Step counters]
// Every rank owns one monotonically increasing step counter in shared memory. A round of
// a collective: each rank writes its contribution into its own slot (slot = round %
// kSlotsPerRank), bumps its step and waits until every rank's step has reached the same
// value (a "phase"), then reads what it needs from the others' slots. All ranks take the same
// phases in the same order, so equal step values mean equal progress. Two slots or more
// per rank (rounds take them in turn; segment.h has kSlotsPerRank = 4) make the "done
// reading" signal unnecessary: with two, a rank rewrites the slot of round r at round r + 2
// at the earliest, after it saw every rank arrive in round r + 1, which each rank does only
// after it finished reading round r (more slots only put that reuse further away).
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shm/segment.h"
#include "shm/sum_order.h"
#include "shm/sync.h"

namespace pycomm::shm {

// The part of a chunk of `n` elements that each rank reduces: whole cache lines, one part
// per rank in rank order, the last shorter or empty. Element range [lo, lo + len) of
// `owner`'s part. Every parallel reduction (all-reduce, reduce) cuts its chunks this way.
struct Parts {
  int64_t n, part;
  Parts(int64_t n, int world, size_t elem) : n(n) {
    const int64_t line = static_cast<int64_t>(kCacheLine / std::min(elem, kCacheLine));
    part = ((n + world - 1) / world + line - 1) / line * line;
  }
  int64_t lo(int owner) const { return std::min(n, owner * part); }
  int64_t len(int owner) const { return std::min(n, lo(owner) + part) - lo(owner); }
};

// Where one rank's bytes go in an all-to-all: offset and length per peer.
struct Split {
  std::vector<size_t> offset;
  std::vector<size_t> bytes;
};

// Several buffers of one dtype seen as one, back to back: the gradients of a DDP bucket
// reduced where they live (See Note [Gradients reduced in place] in reducer/in_place.cpp).
struct Pieces {
  std::vector<char*> ptrs;
  std::vector<size_t> ends;  // where each piece ends, in bytes from the start of the whole

  size_t bytes() const { return ends.empty() ? 0 : ends.back(); }
  void add(char* data, size_t nbytes) {
    if (nbytes == 0) return;
    ptrs.push_back(data);
    ends.push_back(bytes() + nbytes);
  }
  // f(piece_data, offset_in_range, length) for the pieces covering [lo, lo + len), in order.
  template <typename F>
  void each(size_t lo, size_t len, F&& f) const {
    size_t i = std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin();
    for (size_t pos = lo, hi = lo + len; pos < hi; ++i) {
      const size_t start = i == 0 ? 0 : ends[i - 1];
      const size_t take = std::min(hi, ends[i]) - pos;
      f(ptrs[i] + (pos - start), pos - lo, take);
      pos += take;
    }
  }
};

// torch's Python name of a dtype (float32, bfloat16, ...): what users write, in messages.
std::string dtype_name(c10::ScalarType dtype);

// The collectives, as their rounds' tags name them (See Note [Collective identity]).
enum class OpKind : uint8_t {
  kNone,
  kBarrier,
  kBroadcast,
  kAllreduce,
  kReduce,
  kAllgather,
  kReduceScatter,
  kAlltoall,
  kGather,
  kScatter,
};

// What this rank's current collective is: compared with every peer's at its first phase.
struct Identity {
  OpKind kind = OpKind::kNone;
  c10::ScalarType dtype = c10::ScalarType::Byte;
  int64_t count = 0;  // elements of dtype; 0 where ranks may differ (all-to-all)
  comm::OpLabel label;
};

class Channel {
 public:
  Channel(std::unique_ptr<Segment> segment, int rank, bool spin);

  int rank() const { return rank_; }
  int world() const { return world_; }

  // Whether this rank's process writes its flight records on SIGUSR2, for the peers to see;
  // and that signal sent to every peer whose process said so (See Note [Every rank dumps]
  // in dump_peers.cpp). Returns how many were signalled.
  void set_dumps_on_signal(bool yes);
  int signal_peers_to_dump() const;

  void barrier(const OpContext& ctx);
  void broadcast(char* data, size_t bytes, int root, const OpContext& ctx);
  // In place; the same elementwise order on every rank, so all ranks get identical bits.
  // See Note [All-reduce paths] (allreduce.cpp).
  void allreduce(char* data, int64_t n, c10::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                 const OpContext& ctx);
  // The sum of every rank's `data` scaled by `scale` (each rank's elements multiplied by it,
  // rounded, then summed in rank order: the bits of a sum all-reduce of buffers pre-scaled
  // by the same multiply), written back into `data`. float32 and float64. The same
  // collective as allreduce() of `data.bytes()` bytes: a rank may call either.
  void allreduce_pieces(const Pieces& data, c10::ScalarType dtype, double scale,
                        const OpContext& ctx);
  void reduce(char* data, int64_t n, c10::ScalarType dtype, c10d::ReduceOp::RedOpType op, int root,
              const OpContext& ctx);
  // outs[r] receives rank r's `bytes` bytes of `in`.
  void allgather(const char* in, size_t bytes, const std::vector<char*>& outs,
                 const OpContext& ctx);
  // `in` holds world * n elements; this rank's reduced block lands in `out` (n elements),
  // its terms combined in `order` (Note [Gloo's summation order] in sum_order.h says which
  // order each operation takes).
  void reduce_scatter(const char* in, char* out, int64_t n, c10::ScalarType dtype,
                      c10d::ReduceOp::RedOpType op, const SumOrder& order, const OpContext& ctx);
  // The sum of every rank's elements [r x n, (r + 1) x n) of `in` (pieces, as one buffer)
  // scaled by `scale` (as allreduce_pieces scales), into this rank's `out` (n elements);
  // the same collective as reduce_scatter() of the pre-scaled buffer. float32 and float64.
  // See Note [Pieces reduce-scatter] (collectives.cpp).
  void reduce_scatter_pieces(const Pieces& in, c10::ScalarType dtype, double scale, char* out,
                             int64_t n, const OpContext& ctx);
  void alltoall(const char* in, const Split& send, char* out, const Split& recv,
                const OpContext& ctx);
  // On `root`, outs[r] receives rank r's `bytes` bytes of `in`; `outs` is unused elsewhere.
  void gather(const char* in, size_t bytes, const std::vector<char*>& outs, int root,
              const OpContext& ctx);
  // Rank r receives `bytes` bytes of ins[r] from `root`; `ins` is unused elsewhere.
  void scatter(const std::vector<const char*>& ins, char* out, size_t bytes, int root,
               const OpContext& ctx);
  void send(const char* data, size_t bytes, int dst, const OpContext& ctx);
  void recv(char* data, size_t bytes, int src, const OpContext& ctx);
  // recv() from the first peer found with a message waiting for this rank (peers looked at
  // in turn from the one after the last source); returns that peer.
  int recv_any(char* data, size_t bytes, const OpContext& ctx);

  // The waits of the collectives, of send and of recv, in that order.
  std::vector<WaitStats> wait_stats() const {
    return {sync_.stats(), send_sync_.stats(), recv_sync_.stats()};
  }

 private:
  // The collective `ctx` runs now is `kind` of `count` elements of `dtype`: tagged on each
  // of its rounds and checked against the peers' at its first phase.
  void start_op(OpKind kind, c10::ScalarType dtype, int64_t count, const OpContext& ctx);
  void tag_round(int slot);
  // Throw, naming both ranks, when a peer's tag of the current round differs from ours.
  void check_identity(const OpContext& ctx);
  char* begin_round();
  char* peer_slot(int peer) const;
  void phase(const OpContext& ctx);
  // Wait until every other rank's step has reached `target`.
  void wait_peers(uint32_t target, const OpContext& ctx);
  struct Target;  // target.h
  void allreduce_target(const Target& data, int64_t n, c10d::ReduceOp::RedOpType op,
                        const OpContext& ctx);
  void allreduce_whole(const Target& data, int64_t n, c10d::ReduceOp::RedOpType op,
                       const OpContext& ctx);
  void allreduce_pipelined(const Target& data, int64_t n, c10d::ReduceOp::RedOpType op,
                           const OpContext& ctx);
  void reduce_scatter_target(const Target& in, char* out, int64_t n, c10d::ReduceOp::RedOpType op,
                             const SumOrder& order, const OpContext& ctx);
  void reduce_chunk(char* data, int64_t first, int64_t n, c10::ScalarType dtype,
                    c10d::ReduceOp::RedOpType op, int root, const SumOrder& order,
                    const OpContext& ctx);
  void reduce_parts(char* data, int64_t n, c10::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                    int root, const OpContext& ctx);
  size_t alltoall_rounds(const Split& send, size_t per_peer, const OpContext& ctx);

  std::unique_ptr<Segment> segment_;
  Sync sync_;       // collectives
  Sync send_sync_;  // send and recv run on their own threads (see backend.h)
  Sync recv_sync_;
  int rank_;
  int world_;
  uint32_t step_ = 0;
  uint64_t round_ = 0;
  int slot_index_ = 0;
  Identity current_;
  bool check_pending_ = false;  // the current collective's first phase is still to come
  int last_any_source_ = 0;     // recv_any's last source (the receives' lane only)
};

}  // namespace pycomm::shm
