// all_reduce over the slots of a segment: one phase for small buffers, a pipelined
// reduce-scatter + all-gather for the rest (see Note [All-reduce paths]).
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstring>

#include "shm/collectives.h"
#include "shm/reduce_kernels.h"

namespace pycomm::shm {

namespace {

// Note [All-reduce paths]
// Small (up to kWholeReduceBytes, and at most one slot): every rank copies its buffer into
// its slot once, takes one phase, and reduces the whole buffer from all slots itself,
// straight into its tensor. One futex round trip per operation; the arithmetic is repeated
// on every rank, which costs less than a second phase up to a few hundred KiB.
//
// Larger: the buffer is cut into slot-sized chunks, each chunk into one part per rank
// (whole cache lines). Per chunk k, rank r
//   A(k) copies the parts the others own into its slot (k mod kSlotsPerRank), step 2k+1;
//   B(k) waits for every step 2k+1, reduces its own part from its tensor and the others'
//        slots, writing the result to its tensor and its slot at once, step 2k+2;
//   C(k) waits for every step 2k+2 and copies the others' results into its tensor.
// in the order A(0) B(0) A(1) C(0) B(1) A(2) C(1) ...: the copy-in of chunk k+1 runs while
// the others still reduce chunk k. At two ranks each byte of the tensor is read twice
// and written twice (the minimum when the peer cannot read our memory), and no rank waits
// for a whole-group phase between chunks, only for the step it needs.
// Tried and dropped: non-temporal stores for the copy-out (2-7% more CPU time from 4 MiB
// up: the tensor's lines are still cached from the copy-in).
// Reuse of a slot: A(k) rewrites the slot of chunk k - S (S = kSlotsPerRank), read last
// by the others' C(k - S), which each finishes before its B(k - S + 1), i.e. before its
// step reaches 2(k - S) + 4 (steps counted from the operation's start). When the
// operation ends every rank has seen every other reach its final step, like a phase.
constexpr size_t kWholeReduceBytes = 256 * 1024;
// Ranks whose source pointers a small all-reduce keeps on the stack (no allocation).
constexpr unsigned kInlinePeers = 16;
// The unit a symmetric all-reduce publishes its reduced parts in (See Note [Symmetric
// all-reduce]): the others start copying a chunk's results while later chunks are reduced.
constexpr size_t kSymmetricChunkBytes = 1 << 20;

// Element range [lo, lo + len) of the part that `owner` reduces in a chunk of `n`.
struct Parts {
  int64_t n, part;
  Parts(int64_t n, int world, size_t elem) : n(n) {
    const int64_t line = static_cast<int64_t>(kCacheLine / std::min(elem, kCacheLine));
    part = ((n + world - 1) / world + line - 1) / line * line;
  }
  int64_t lo(int owner) const { return std::min(n, owner * part); }
  int64_t len(int owner) const { return std::min(n, lo(owner) + part) - lo(owner); }
};

}  // namespace

void Channel::allreduce(char* data, int64_t n, c10::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                        const OpContext& ctx) {
  const size_t bytes = n * c10::elementSize(dtype);
  if (bytes <= std::min(kWholeReduceBytes, segment_->slot_bytes())) {
    allreduce_whole(data, n, dtype, op, ctx);
  } else {
    allreduce_pipelined(data, n, dtype, op, ctx);
  }
}

void Channel::allreduce_whole(char* data, int64_t n, c10::ScalarType dtype,
                              c10d::ReduceOp::RedOpType op, const OpContext& ctx) {
  std::memcpy(begin_round(), data, n * c10::elementSize(dtype));
  phase(ctx);
  c10::SmallVector<const void*, kInlinePeers> srcs(world_);
  for (int p = 0; p < world_; ++p) srcs[p] = p == rank_ ? data : peer_slot(p);
  reduce_buffers(dtype, op, data, srcs.data(), world_, n, world_);
}

void Channel::allreduce_pipelined(char* data, int64_t n, c10::ScalarType dtype,
                                  c10d::ReduceOp::RedOpType op, const OpContext& ctx) {
  const size_t elem = c10::elementSize(dtype);
  const int64_t chunk = static_cast<int64_t>(segment_->slot_bytes() / elem);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const uint32_t base = step_;
  const uint64_t first_round = round_;
  round_ += chunks;
  step_ = base + static_cast<uint32_t>(2 * chunks);
  auto slot = [&](int r, int64_t k) {
    return segment_->slot(r, static_cast<int>((first_round + k) % kSlotsPerRank));
  };
  auto at = [&](int64_t k) { return data + k * chunk * elem; };
  auto parts = [&](int64_t k) { return Parts(std::min(chunk, n - k * chunk), world_, elem); };
  auto publish = [&](int64_t step) {
    Sync::publish(segment_->rank(rank_).step, base + static_cast<uint32_t>(step));
  };
  auto copy_in = [&](int64_t k) {
    if (k + 2 > kSlotsPerRank) {
      wait_peers(base + static_cast<uint32_t>(2 * (k - kSlotsPerRank) + 4), ctx);
    }
    Parts ps = parts(k);
    char* mine = slot(rank_, k);
    for (int p = 0; p < world_; ++p) {
      const size_t off = ps.lo(p) * elem;
      if (p != rank_) std::memcpy(mine + off, at(k) + off, ps.len(p) * elem);
    }
    publish(2 * k + 1);
  };
  std::vector<const void*> srcs(world_);
  auto reduce_own = [&](int64_t k) {
    wait_peers(base + static_cast<uint32_t>(2 * k + 1), ctx);
    Parts ps = parts(k);
    const size_t off = ps.lo(rank_) * elem;
    for (int p = 0; p < world_; ++p) srcs[p] = (p == rank_ ? at(k) : slot(p, k)) + off;
    reduce_buffers(dtype, op, at(k) + off, srcs.data(), world_, ps.len(rank_), world_,
                   slot(rank_, k) + off);
    publish(2 * k + 2);
  };
  auto copy_out = [&](int64_t k) {
    wait_peers(base + static_cast<uint32_t>(2 * k + 2), ctx);
    Parts ps = parts(k);
    for (int p = 0; p < world_; ++p) {
      const size_t off = ps.lo(p) * elem;
      if (p != rank_) std::memcpy(at(k) + off, slot(p, k) + off, ps.len(p) * elem);
    }
  };
  copy_in(0);
  for (int64_t k = 0; k < chunks; ++k) {
    reduce_own(k);
    if (k + 1 < chunks) copy_in(k + 1);
    copy_out(k);
  }
}

// Note [Symmetric all-reduce]
// Every rank's tensor lies at the same offset of its own arena file, which every other rank
// has mapped (Note [Symmetric buffers]). One phase says that every rank's values are in
// place (and checks that the ranks passed the same tensor). Then per chunk k, rank r
// reduces its part of chunk k from all ranks' copies straight into its own copy and
// publishes step k; afterwards, for each chunk in turn, it waits for the others' step k and
// copies their parts' results from their copies into its own. A last phase says that
// nobody reads this rank's copy any more, so the caller may write it again (the next
// backward does). A part is written only by its owner until that owner published it, and
// read by the others only after: no rank reads what another is writing. Small tensors take
// the one-phase path (Note [All-reduce paths]): the copy into the slot is cheaper than two
// more phases.
void Channel::allreduce_symmetric(const Arena& arena, size_t offset, int64_t n,
                                  c10::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                                  const OpContext& ctx) {
  const size_t elem = c10::elementSize(dtype);
  char* mine = arena.mine() + offset;
  if (world_ == 1 || n * elem <= std::min(kWholeReduceBytes, segment_->slot_bytes())) {
    allreduce(mine, n, dtype, op, ctx);
    return;
  }
  struct Call {  // no padding: compared bytewise
    uint64_t arena, offset;
    int64_t n, dtype;
  };
  const Call call{arena.id(), offset, n, static_cast<int64_t>(dtype)};
  std::memcpy(begin_round(), &call, sizeof(call));
  phase(ctx);
  for (int p = 0; p < world_; ++p) {
    Call other;
    std::memcpy(&other, peer_slot(p), sizeof(other));
    TORCH_CHECK(p == rank_ || std::memcmp(&other, &call, sizeof(call)) == 0,
                "pycomm all_reduce of a symmetric buffer: rank ", rank_, " passed ", n,
                " elements of dtype ", dtype, " at byte ", offset, " of arena ", arena.id(),
                ", rank ", p, " passed ", other.n, " elements at byte ", other.offset, " of arena ",
                other.arena, " (dtype ", static_cast<c10::ScalarType>(other.dtype),
                "): every rank must all-reduce the same bucket");
  }
  const int64_t chunk = static_cast<int64_t>(kSymmetricChunkBytes / elem);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const uint32_t base = step_;
  step_ = base + static_cast<uint32_t>(chunks + 1);
  auto at = [&](int p, int64_t k, int64_t lo) {
    return arena.base(p) + offset + (k * chunk + lo) * elem;
  };
  auto parts = [&](int64_t k) { return Parts(std::min(chunk, n - k * chunk), world_, elem); };
  c10::SmallVector<const void*, kInlinePeers> srcs(world_);
  for (int64_t k = 0; k < chunks; ++k) {
    Parts ps = parts(k);
    for (int p = 0; p < world_; ++p) srcs[p] = at(p, k, ps.lo(rank_));
    reduce_buffers(dtype, op, at(rank_, k, ps.lo(rank_)), srcs.data(), world_, ps.len(rank_),
                   world_);
    Sync::publish(segment_->rank(rank_).step, base + static_cast<uint32_t>(k + 1));
  }
  for (int64_t k = 0; k < chunks; ++k) {
    wait_peers(base + static_cast<uint32_t>(k + 1), ctx);
    Parts ps = parts(k);
    for (int p = 0; p < world_; ++p) {
      if (p != rank_) std::memcpy(at(rank_, k, ps.lo(p)), at(p, k, ps.lo(p)), ps.len(p) * elem);
    }
  }
  Sync::publish(segment_->rank(rank_).step, step_);
  wait_peers(step_, ctx);
}

}  // namespace pycomm::shm
