// all_reduce over the slots of a segment: one phase for small buffers, a pipelined
// reduce-scatter + all-gather for the rest (see Note [All-reduce paths]).
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstring>

#include "shm/collectives.h"
#include "shm/reduce_kernels.h"
#include "shm/sum_order.h"
#include "shm/target.h"

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
// up: the tensor's lines are still cached from the copy-in). Also tried and dropped (2026-11-24,
// commit d932511): buffers every rank maps (DDP buckets allocated in /dev/shm), reduced in
// place from the peers' copies with no slot in between. Fewer bytes touched, but not fewer
// bytes from DRAM: the slots stay in cache, so the copies through them cost almost nothing,
// while reading a peer's part straight from its buffer is a DRAM read. Two ranks, idle,
// in place vs through the slots, per all-reduce: 25 MiB 3.06 vs 3.32 ms, 100 MiB 14.5 vs
// 12.4 ms; DDP step (MLP, 25 MiB buckets) 134.3 vs 133.7 ms.
// Reuse of a slot: A(k) rewrites the slot of chunk k - S (S = kSlotsPerRank), read last
// by the others' C(k - S), which each finishes before its B(k - S + 1), i.e. before its
// step reaches 2(k - S) + 4 (steps counted from the operation's start). When the
// operation ends every rank has seen every other reach its final step, like a phase.
constexpr size_t kWholeReduceBytes = 256 * 1024;
// Ranks whose source pointers a small all-reduce keeps on the stack (no allocation).
constexpr unsigned kInlinePeers = 16;

}  // namespace

void Channel::allreduce(char* data, int64_t n, c10::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                        const OpContext& ctx) {
  allreduce_target(Target{data, nullptr, dtype, 1.0}, n, op, ctx);
}

// Note [Pieces all-reduce]
// The same schedule and the same arithmetic as a one-buffer all-reduce (so ranks may mix
// the two, and a DDP bucket reduced in place gets the bits of the same bucket reduced
// through its buffer), with this rank's elements read from its pieces and multiplied by
// the scale as they are read: the parts the others reduce are copied into the slot scaled
// (scale_copy), this rank's own part is reduced straight from the pieces, its elements
// scaled inside the sum (sum_scaling_one), the result written to the pieces and the slot
// at once, and the others' results are copied from their slots into the pieces. The
// bytes moved are those of the one-buffer path; what the pieces save is the copies into
// and out of a buffer around the collective. A first version copied whole chunks into the
// slot scaled and reduced the own part there: 14.1 ms of CPU per all-reduce of the
// benchmark MLP's 12 gradients (100.7 MB, 2 ranks, idle) against 11.5 ms for one buffer.
void Channel::allreduce_pieces(const Pieces& data, c10::ScalarType dtype, double scale,
                               const OpContext& ctx) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "pycomm all_reduce of pieces: float32 or float64, got ", dtype);
  const int64_t n = static_cast<int64_t>(data.bytes() / c10::elementSize(dtype));
  allreduce_target(Target{nullptr, &data, dtype, scale}, n, c10d::ReduceOp::SUM, ctx);
}

void Channel::allreduce_target(const Target& data, int64_t n, c10d::ReduceOp::RedOpType op,
                               const OpContext& ctx) {
  start_op(OpKind::kAllreduce, data.dtype, n, ctx);
  const size_t bytes = n * c10::elementSize(data.dtype);
  if (bytes <= std::min(kWholeReduceBytes, segment_->slot_bytes())) {
    allreduce_whole(data, n, op, ctx);
  } else {
    allreduce_pipelined(data, n, op, ctx);
  }
}

void Channel::allreduce_whole(const Target& data, int64_t n, c10d::ReduceOp::RedOpType op,
                              const OpContext& ctx) {
  const c10::ScalarType dtype = data.dtype;
  const size_t elem = c10::elementSize(dtype);
  const size_t bytes = n * elem;
  char* mine = begin_round();
  data.take(mine, 0, bytes);
  phase(ctx);
  c10::SmallVector<const void*, kInlinePeers> srcs(world_);
  const SumOrder order = SumOrder::whole(n);
  // [off, off + len) elements of the whole, from `own` (this rank's copy of them) and the
  // peers' slots, into `out`. See Note [Gloo's summation order] (sum_order.h).
  auto sum = [&](char* out, const char* own, int64_t off, int64_t len) {
    order.each(world_, elem, off, len, [&](int64_t lo, int64_t count, RingTerms terms) {
      terms.list(
          rank_, own + lo * elem, [&](int p) { return peer_slot(p) + (off + lo) * elem; },
          srcs.data());
      reduce_buffers(dtype, op, out + lo * elem, srcs.data(), world_, count, world_);
    });
  };
  if (data.pieces == nullptr) {
    sum(data.data, data.data, 0, n);
    return;
  }
  data.pieces->each(0, bytes, [&](char* piece, size_t off, size_t len) {
    sum(piece, mine + off, static_cast<int64_t>(off / elem), static_cast<int64_t>(len / elem));
  });
}

namespace {

// One chunk's own part of the pipelined all-reduce: `len` bytes at `begin` of the data,
// combined over every rank's copy (this rank's in the data, a peer p's at peer(p)) in the
// order of `order` (Note [Gloo's summation order]) into the data and into `own`, this
// rank's slot, for the peers to copy out. With pieces, each piece is reduced where it is,
// scaled as it is read (Note [Pieces all-reduce]).
template <typename Data, typename PeerSlot>
void reduce_part(const Data& data, c10d::ReduceOp::RedOpType op, const SumOrder& order,
                 size_t begin, size_t len, int world, int rank, char* own, const PeerSlot& peer,
                 std::vector<const void*>& srcs) {
  const c10::ScalarType dtype = data.dtype;
  const size_t elem = c10::elementSize(dtype);
  // Elements [off, off + count) of the part (bytes `at` on), this rank's copy at `mine`.
  auto each = [&](size_t at, int64_t count, char* mine, auto&& reduce) {
    order.each(world, elem, static_cast<int64_t>((begin + at) / elem), count,
               [&](int64_t lo, int64_t n, RingTerms terms) {
                 const size_t b = lo * elem;
                 terms.list(rank, mine + b, [&](int p) { return peer(p) + at + b; }, srcs.data());
                 reduce(mine + b, own + at + b, n, terms.position(rank));
               });
  };
  if (data.pieces != nullptr) {
    data.pieces->each(begin, len, [&](char* piece, size_t o, size_t bytes) {
      each(o, static_cast<int64_t>(bytes / elem), piece,
           [&](char* out, char* copy, int64_t n, int scaled) {
             sum_scaling_one(dtype, out, srcs.data(), world, n, scaled, data.scale, copy);
           });
    });
    return;
  }
  each(0, static_cast<int64_t>(len / elem), data.data + begin,
       [&](char* out, char* copy, int64_t n, int) {
         reduce_buffers(dtype, op, out, srcs.data(), world, n, world, copy);
       });
}

}  // namespace

void Channel::allreduce_pipelined(const Target& data, int64_t n, c10d::ReduceOp::RedOpType op,
                                  const OpContext& ctx) {
  const size_t elem = c10::elementSize(data.dtype);
  const int64_t chunk = static_cast<int64_t>(segment_->slot_bytes() / elem);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const uint32_t base = step_;
  const uint64_t first_round = round_;
  round_ += chunks;
  step_ = base + static_cast<uint32_t>(2 * chunks);
  auto slot = [&](int r, int64_t k) {
    return segment_->slot(r, static_cast<int>((first_round + k) % kSlotsPerRank));
  };
  auto at = [&](int64_t k) { return static_cast<size_t>(k * chunk) * elem; };  // bytes
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
      if (p != rank_) data.take(mine + off, at(k) + off, ps.len(p) * elem);
    }
    tag_round(static_cast<int>((first_round + k) % kSlotsPerRank));
    publish(2 * k + 1);
  };
  std::vector<const void*> srcs(world_);
  const SumOrder order = SumOrder::whole(n);
  auto reduce_own = [&](int64_t k) {
    wait_peers(base + static_cast<uint32_t>(2 * k + 1), ctx);
    if (k == 0) {  // every peer's first round is in: See Note [Collective identity]
      slot_index_ = static_cast<int>(first_round % kSlotsPerRank);
      check_identity(ctx);
    }
    Parts ps = parts(k);
    const size_t off = ps.lo(rank_) * elem;
    reduce_part(
        data, op, order, at(k) + off, ps.len(rank_) * elem, world_, rank_, slot(rank_, k) + off,
        [&](int p) { return slot(p, k) + off; }, srcs);
    publish(2 * k + 2);
  };
  auto copy_out = [&](int64_t k) {
    wait_peers(base + static_cast<uint32_t>(2 * k + 2), ctx);
    Parts ps = parts(k);
    for (int p = 0; p < world_; ++p) {
      const size_t off = ps.lo(p) * elem;
      if (p != rank_) data.put(at(k) + off, slot(p, k) + off, ps.len(p) * elem);
    }
  };
  copy_in(0);
  for (int64_t k = 0; k < chunks; ++k) {
    reduce_own(k);
    if (k + 1 < chunks) copy_in(k + 1);
    copy_out(k);
  }
}

}  // namespace pycomm::shm
