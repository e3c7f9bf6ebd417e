// gather and scatter: rounds over the slots of a segment (see Note [Step counters]). Every
// rank takes the same rounds, as the byte count is the same on every rank; only the root
// copies out (gather) or in (scatter).
#include <algorithm>
#include <cstring>

#include "shm/collectives.h"

namespace pycomm::shm {

// Each round every rank but the root puts one slot's worth of its bytes in its slot; the
// root copies its own bytes straight from `in`.
void Channel::gather(const char* in, size_t bytes, const std::vector<char*>& outs, int root,
                     const OpContext& ctx) {
  start_op(OpKind::kGather, c10::ScalarType::Byte, static_cast<int64_t>(bytes), ctx);
  const size_t chunk = segment_->slot_bytes();
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t len = std::min(chunk, bytes - off);
    char* mine = begin_round();
    if (rank_ != root) std::memcpy(mine, in + off, len);
    phase(ctx);
    if (rank_ != root) continue;
    for (int p = 0; p < world_; ++p) {
      const char* src = p == root ? in + off : peer_slot(p);
      if (outs[p] + off != src) std::memcpy(outs[p] + off, src, len);  // may alias `in`
    }
  }
}

// Each round the root's slot holds one piece per rank (slot / world bytes, whole cache
// lines, at offset rank * piece); the root copies its own piece straight from ins[root].
void Channel::scatter(const std::vector<const char*>& ins, char* out, size_t bytes, int root,
                      const OpContext& ctx) {
  start_op(OpKind::kScatter, c10::ScalarType::Byte, static_cast<int64_t>(bytes), ctx);
  const size_t piece = segment_->slot_bytes() / world_ / kCacheLine * kCacheLine;
  for (size_t off = 0; off < bytes; off += piece) {
    const size_t len = std::min(piece, bytes - off);
    char* mine = begin_round();
    if (rank_ == root) {
      for (int p = 0; p < world_; ++p) {
        if (p != root) std::memcpy(mine + p * piece, ins[p] + off, len);
      }
    }
    phase(ctx);
    const char* src = rank_ == root ? ins[root] + off : peer_slot(root) + rank_ * piece;
    if (out + off != src) std::memcpy(out + off, src, len);  // the root's may alias ins[root]
  }
}

}  // namespace pycomm::shm
