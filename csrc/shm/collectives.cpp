// Round-based collectives over the slots of a segment (see Note [Step counters]).
#include "shm/collectives.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

#include "shm/reduce_kernels.h"
#include "shm/target.h"

namespace pycomm::shm {

namespace {

// reduce_chunk, one round of the reduce collective: below kParallelReduceBytes per round
// every rank reduces the whole chunk itself (one phase); above it the chunk is cut into
// Parts and each rank reduces its own part, as the all-reduce does (Note [All-reduce
// paths] in allreduce.cpp), without its pipelining: two phases per chunk. A rank copies
// into its slot only the parts others reduce and reads its own straight from its tensor:
// 4 bytes moved per byte of tensor at two ranks, where a copy in and a copy out of
// everything would take 5.5.
constexpr size_t kParallelReduceBytes = 64 * 1024;

size_t align_down(size_t n, size_t to) { return n / to * to; }

}  // namespace

Channel::Channel(std::unique_ptr<Segment> segment, int rank, bool spin)
    : segment_(std::move(segment)),
      sync_(*segment_, spin),
      send_sync_(*segment_, spin),
      recv_sync_(*segment_, spin),
      rank_(rank),
      world_(segment_->world()) {}

// Note [Collective identity]
// Ranks pair their collectives by issue order alone: a rank that skipped a DDP backward, or
// ran a no_sync micro-step the others did not, reduces its step 2 with the others' step 1
// and nothing fails until much later, if ever. So every round carries a tag in the rank's
// RankCtl (one per slot, stored before the round's step is published): what the collective
// is (kind, dtype, elements) and the caller's label (a DDP bucket's index, its rank's
// synchronized step, and how many forwards with grad enabled it ran since its last
// synchronized backward: see Reducer::launch). At the first phase of each collective, once
// every peer has published that round, each rank compares every peer's tag with its own and
// throws on a difference, naming itself and the peer and what each is at. Every rank sees
// the same tags, so if any two differ every rank throws, at the same operation: the group
// then fails as after any error. A tag lives as long as its slot's data: a peer rewrites
// the tag of round r at round r + kSlotsPerRank at the earliest, after this rank arrived in
// later rounds, which it does only after its check (See Note [Step counters]).
// Compared: kind, dtype and elements always (an all-to-all's counts may differ, so they
// are not); labels where both ranks have one (a joined rank's shadow all-reduce has none).
// The cost is five relaxed stores per round and one cache line read per peer per
// collective: no extra round, no extra wait.
void Channel::start_op(OpKind kind, c10::ScalarType dtype, int64_t count, const OpContext& ctx) {
  current_ = Identity{kind, dtype, count, ctx.label};
  check_pending_ = true;
}

void Channel::tag_round(int slot) {
  OpTag& tag = segment_->rank(rank_).tags[slot];
  tag.what.store(static_cast<uint64_t>(current_.kind) |
                     static_cast<uint64_t>(static_cast<uint8_t>(current_.dtype)) << 8,
                 std::memory_order_relaxed);
  tag.count.store(current_.count, std::memory_order_relaxed);
  tag.bucket.store(current_.label.bucket, std::memory_order_relaxed);
  tag.forwards.store(current_.label.forwards, std::memory_order_relaxed);
  tag.step.store(current_.label.step, std::memory_order_relaxed);
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    default: return c10::toString(dtype);
  }
}

namespace {

const char* kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kBarrier: return "barrier";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllreduce: return "all_reduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "all_to_all";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kNone: break;
  }
  return "no collective";
}

Identity read_tag(const OpTag& tag) {
  const uint64_t what = tag.what.load(std::memory_order_relaxed);
  Identity id;
  id.kind = static_cast<OpKind>(what & 0xff);
  id.dtype = static_cast<c10::ScalarType>(static_cast<int8_t>((what >> 8) & 0xff));
  id.count = tag.count.load(std::memory_order_relaxed);
  id.label.bucket = tag.bucket.load(std::memory_order_relaxed);
  id.label.forwards = tag.forwards.load(std::memory_order_relaxed);
  id.label.step = tag.step.load(std::memory_order_relaxed);
  return id;
}

bool same_collective(const Identity& a, const Identity& b) {
  if (a.kind != b.kind || a.dtype != b.dtype) return false;
  if (a.kind != OpKind::kAlltoall && a.count != b.count) return false;
  return comm::same_label(a.label, b.label);
}

std::string describe(const Identity& id) {
  std::ostringstream out;
  if (id.label.labelled()) out << comm::describe(id.label) << " (";
  out << kind_name(id.kind);
  if (id.kind == OpKind::kBroadcast || id.kind == OpKind::kAllgather ||
      id.kind == OpKind::kGather || id.kind == OpKind::kScatter) {
    out << " of " << id.count << " bytes";
  } else if (id.kind != OpKind::kBarrier && id.kind != OpKind::kAlltoall &&
             id.kind != OpKind::kNone) {
    out << " of " << id.count << " " << dtype_name(id.dtype) << " elements";
  }
  if (id.label.labelled()) out << ")";
  return out.str();
}

}  // namespace

void Channel::check_identity(const OpContext& ctx) {
  check_pending_ = false;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const Identity theirs = read_tag(segment_->rank(p).tags[slot_index_]);
    if (same_collective(current_, theirs)) continue;
    const bool steps = current_.label.labelled() && theirs.label.labelled();
    C10_THROW_ERROR(DistBackendError,
                    c10::str("pycomm ", ctx.op, " (operation #", ctx.seq, " on rank ", rank_,
                             "): ranks ", rank_, " and ", p, " are in different collectives: rank ",
                             rank_, " is at ", describe(current_), ", rank ", p, " at ",
                             describe(theirs), steps ? ": " : "",
                             steps ? comm::kLabelsDifferHint
                                   : ": the ranks issued different collectives in this order"));
  }
}

char* Channel::begin_round() {
  slot_index_ = static_cast<int>(round_ % kSlotsPerRank);
  ++round_;
  tag_round(slot_index_);
  return segment_->slot(rank_, slot_index_);
}

char* Channel::peer_slot(int peer) const { return segment_->slot(peer, slot_index_); }

void Channel::phase(const OpContext& ctx) {
  ++step_;
  Sync::publish(segment_->rank(rank_).step, step_);
  wait_peers(step_, ctx);
  if (check_pending_) check_identity(ctx);  // See Note [Collective identity]
}

void Channel::wait_peers(uint32_t target, const OpContext& ctx) {
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) sync_.wait(segment_->rank(p).step, target, p, ctx, &segment_->rank(rank_).step);
  }
}

void Channel::barrier(const OpContext& ctx) {
  start_op(OpKind::kBarrier, c10::ScalarType::Byte, 0, ctx);
  begin_round();
  phase(ctx);
}

void Channel::broadcast(char* data, size_t bytes, int root, const OpContext& ctx) {
  start_op(OpKind::kBroadcast, c10::ScalarType::Byte, static_cast<int64_t>(bytes), ctx);
  const size_t chunk = segment_->slot_bytes();
  for (size_t off = 0; off < bytes; off += chunk) {
    size_t len = std::min(chunk, bytes - off);
    char* mine = begin_round();
    if (rank_ == root) std::memcpy(mine, data + off, len);
    phase(ctx);
    if (rank_ != root) std::memcpy(data + off, peer_slot(root), len);
  }
}

void Channel::reduce(char* data, int64_t n, c10::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                     int root, const OpContext& ctx) {
  start_op(OpKind::kReduce, dtype, n, ctx);
  reduce_parts(data, n, dtype, op, root, ctx);
}

// root < 0: every rank receives the result; else only `root` does. all_reduce has its own
// paths (allreduce.cpp); this one serves reduce.
void Channel::reduce_parts(char* data, int64_t n, c10::ScalarType dtype,
                           c10d::ReduceOp::RedOpType op, int root, const OpContext& ctx) {
  const size_t elem = c10::elementSize(dtype);
  const int64_t chunk = static_cast<int64_t>(segment_->slot_bytes() / elem);
  const SumOrder order = SumOrder::whole(n, GlooRing::kReduce);
  for (int64_t off = 0; off < n; off += chunk) {
    reduce_chunk(data + off * elem, off, std::min(chunk, n - off), dtype, op, root, order, ctx);
  }
}

// See the comment at kParallelReduceBytes for the two paths. The chunk is elements
// [first, first + n) of the whole, whose `order` its terms take.
void Channel::reduce_chunk(char* data, int64_t first, int64_t n, c10::ScalarType dtype,
                           c10d::ReduceOp::RedOpType op, int root, const SumOrder& order,
                           const OpContext& ctx) {
  const size_t elem = c10::elementSize(dtype);
  const size_t bytes = n * elem;
  const bool receives = root < 0 || root == rank_;
  std::vector<const void*> srcs(world_);
  // Elements [lo, lo + len) of the chunk, this rank's terms at mine[lo], into result[lo].
  auto sum = [&](char* result, const char* mine, int64_t lo, int64_t len) {
    order.each(world_, elem, first + lo, len, [&](int64_t at, int64_t count, RingTerms terms) {
      const size_t b = (lo + at) * elem;
      terms.list(rank_, mine + b, [&](int p) { return peer_slot(p) + b; }, srcs.data());
      reduce_buffers(dtype, op, result + b, srcs.data(), world_, count, world_);
    });
  };
  if (bytes < kParallelReduceBytes) {
    std::memcpy(begin_round(), data, bytes);
    phase(ctx);
    if (!receives) return;
    sum(data, data, 0, n);
    return;
  }
  // Parts of whole cache lines, one per rank; the last may be shorter or empty.
  const Parts parts(n, world_, elem);
  auto range = [&](int p) { return std::make_pair(parts.lo(p) * elem, parts.len(p) * elem); };
  char* mine = begin_round();
  for (int p = 0; p < world_; ++p) {
    auto [off, len] = range(p);
    if (p != rank_) std::memcpy(mine + off, data + off, len);
  }
  phase(ctx);
  auto [off, len] = range(rank_);
  char* result = receives ? data : mine;
  sum(result, data, parts.lo(rank_), parts.len(rank_));
  if (root < 0) std::memcpy(mine + off, result + off, len);  // the other ranks copy it from here
  phase(ctx);
  if (!receives) return;
  for (int p = 0; p < world_; ++p) {
    auto [poff, plen] = range(p);
    if (p != rank_) std::memcpy(data + poff, peer_slot(p) + poff, plen);
  }
}

void Channel::allgather(const char* in, size_t bytes, const std::vector<char*>& outs,
                        const OpContext& ctx) {
  start_op(OpKind::kAllgather, c10::ScalarType::Byte, static_cast<int64_t>(bytes), ctx);
  const size_t chunk = segment_->slot_bytes();
  // In place (all_gather_into_tensor whose input is this rank's block of the output, as
  // a sharded optimizer's parameter all-gather is) the rank's own block already holds
  // what its slot would give back: a third of the copies saved.
  const bool in_place = outs[rank_] == in;
  for (size_t off = 0; off < bytes; off += chunk) {
    size_t len = std::min(chunk, bytes - off);
    std::memcpy(begin_round(), in + off, len);
    phase(ctx);
    for (int p = 0; p < world_; ++p) {
      if (p != rank_ || !in_place) std::memcpy(outs[p] + off, peer_slot(p), len);
    }
  }
}

void Channel::reduce_scatter(const char* in, char* out, int64_t n, c10::ScalarType dtype,
                             c10d::ReduceOp::RedOpType op, const SumOrder& order,
                             const OpContext& ctx) {
  reduce_scatter_target(Target{const_cast<char*>(in), nullptr, dtype, 1.0}, out, n, op, order, ctx);
}

void Channel::reduce_scatter_target(const Target& in, char* out, int64_t n,
                                    c10d::ReduceOp::RedOpType op, const SumOrder& order,
                                    const OpContext& ctx) {
  const c10::ScalarType dtype = in.dtype;
  start_op(OpKind::kReduceScatter, dtype, n, ctx);
  const size_t elem = c10::elementSize(dtype);
  const int64_t chunk = static_cast<int64_t>(segment_->slot_bytes() / world_ / elem);
  std::vector<const void*> srcs(world_);
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t len = std::min(chunk, n - off);
    const size_t block = len * elem;
    char* mine = begin_round();
    for (int p = 0; p < world_; ++p) {
      if (p != rank_) in.take(mine + p * block, (p * n + off) * elem, block);
    }
    phase(ctx);
    const size_t own = (rank_ * n + off) * elem;
    char* result = out + off * elem;
    // Elements [o, o + count) of this round's block, this rank's terms at `terms_at`.
    auto each = [&](size_t o, int64_t count, const char* terms_at, auto&& reduce) {
      order.each(world_, elem, off + static_cast<int64_t>(o / elem), count,
                 [&](int64_t lo, int64_t m, RingTerms terms) {
                   const size_t b = lo * elem;
                   terms.list(
                       rank_, terms_at + b,
                       [&](int p) { return peer_slot(p) + rank_ * block + o + b; }, srcs.data());
                   reduce(result + o + b, m, terms.position(rank_));
                 });
    };
    if (in.pieces != nullptr) {  // See Note [Pieces reduce-scatter]
      in.pieces->each(own, block, [&](char* piece, size_t o, size_t bytes) {
        each(o, static_cast<int64_t>(bytes / elem), piece, [&](char* to, int64_t m, int scaled) {
          sum_scaling_one(dtype, to, srcs.data(), world_, m, scaled, in.scale, nullptr);
        });
      });
      continue;
    }
    each(0, len, in.data + own, [&](char* to, int64_t m, int) {
      reduce_buffers(dtype, op, to, srcs.data(), world_, m, world_);
    });
  }
}

// Note [Pieces reduce-scatter]
// A sharded optimizer's bucket reduced where its gradients are (Note [Gradients reduced in
// place] in reducer/in_place.cpp): the same rounds and arithmetic as reduce_scatter() of
// the bucket pre-scaled, so ranks may mix the two. The others' blocks are copied into the
// slot scaled as they are read (Target::take); this rank's own block is summed straight
// from its pieces, its elements scaled inside the sum (sum_scaling_one), into `out`.
// Against the bucket path this saves the gradients' copy into the bucket: a read and a
// write of every gradient byte per step, and the bucket's memory.
void Channel::reduce_scatter_pieces(const Pieces& in, c10::ScalarType dtype, double scale,
                                    char* out, int64_t n, const OpContext& ctx) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "pycomm reduce_scatter of pieces: float32 or float64, got ", dtype);
  TORCH_CHECK(static_cast<int64_t>(in.bytes() / c10::elementSize(dtype)) >= world_ * n,
              "pycomm reduce_scatter of pieces: ", in.bytes() / c10::elementSize(dtype),
              " elements for ", world_, " ranges of ", n);
  reduce_scatter_target(Target{nullptr, &in, dtype, scale}, out, n, c10d::ReduceOp::SUM,
                        SumOrder::scattered(world_, rank_, n), ctx);
}

// One round to agree on the longest message of any pair, so every rank takes the same
// number of rounds.
size_t Channel::alltoall_rounds(const Split& send, size_t per_peer, const OpContext& ctx) {
  uint64_t longest = *std::max_element(send.bytes.begin(), send.bytes.end());
  std::memcpy(begin_round(), &longest, sizeof(longest));
  phase(ctx);
  for (int p = 0; p < world_; ++p) {
    uint64_t theirs;
    std::memcpy(&theirs, peer_slot(p), sizeof(theirs));
    longest = std::max(longest, theirs);
  }
  return (longest + per_peer - 1) / per_peer;
}

void Channel::alltoall(const char* in, const Split& send, char* out, const Split& recv,
                       const OpContext& ctx) {
  start_op(OpKind::kAlltoall, c10::ScalarType::Byte, 0, ctx);
  const size_t per_peer = align_down(segment_->slot_bytes() / world_, kCacheLine);
  const size_t rounds = alltoall_rounds(send, per_peer, ctx);
  auto piece = [&](size_t total, size_t r) {
    size_t lo = std::min(total, r * per_peer);
    return std::make_pair(lo, std::min(total, lo + per_peer) - lo);
  };
  for (size_t r = 0; r < rounds; ++r) {
    char* mine = begin_round();
    for (int p = 0; p < world_; ++p) {
      auto [lo, len] = piece(send.bytes[p], r);
      std::memcpy(mine + p * per_peer, in + send.offset[p] + lo, len);
    }
    phase(ctx);
    for (int p = 0; p < world_; ++p) {
      auto [lo, len] = piece(recv.bytes[p], r);
      std::memcpy(out + recv.offset[p] + lo, peer_slot(p) + rank_ * per_peer, len);
    }
  }
}

}  // namespace pycomm::shm
