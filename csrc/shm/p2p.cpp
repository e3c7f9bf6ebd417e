// send/recv through the per-pair mailboxes of the segment. A mailbox holds one chunk: the
// sender waits until the receiver has taken the previous one, so a message that fits in
// one chunk completes without the receiver, and a longer one streams through.
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "shm/collectives.h"

namespace pycomm::shm {

void Channel::send(const char* data, size_t bytes, int dst, const OpContext& ctx) {
  MailCtl& mail = segment_->mail(rank_, dst);
  char* box = segment_->mailbox(rank_, dst);
  const size_t chunk = segment_->mailbox_bytes();
  size_t off = 0;
  do {  // at least one chunk, so that an empty message is still matched
    size_t len = std::min(chunk, bytes - off);
    uint32_t sent = mail.sent.value.load(std::memory_order_relaxed);
    send_sync_.wait(mail.taken, sent, dst, ctx);
    std::memcpy(box, data + off, len);
    mail.chunk_bytes.store(len, std::memory_order_relaxed);
    mail.total_bytes.store(bytes, std::memory_order_relaxed);
    Sync::publish(mail.sent, sent + 1);
    off += len;
  } while (off < bytes);
}

void Channel::recv(char* data, size_t bytes, int src, const OpContext& ctx) {
  MailCtl& mail = segment_->mail(src, rank_);
  const char* box = segment_->mailbox(src, rank_);
  size_t off = 0;
  do {
    uint32_t taken = mail.taken.value.load(std::memory_order_relaxed);
    recv_sync_.wait(mail.sent, taken + 1, src, ctx);
    size_t total = mail.total_bytes.load(std::memory_order_relaxed);
    if (total != bytes) {
      throw_op_error(ctx, "rank " + std::to_string(src) + " sent " + std::to_string(total) +
                              " bytes, this rank expects " + std::to_string(bytes));
    }
    size_t len = mail.chunk_bytes.load(std::memory_order_relaxed);
    std::memcpy(data + off, box, len);
    Sync::publish(mail.taken, taken + 1);
    off += len;
  } while (off < bytes);
}

// Note [Receiving from any source]
// A message is waiting from src when its mailbox to this rank has a chunk this rank has not
// taken (sent > taken). recv_any looks at the peers' mailboxes in turn, starting after the
// last source it took from, so that a fast sender cannot starve the others, pausing
// briefly between rounds, until one has a message or the deadline passes; then it is an
// ordinary recv() from that peer, which also checks the message's size.
int Channel::recv_any(char* data, size_t bytes, const OpContext& ctx) {
  TORCH_CHECK_VALUE(world_ > 1, "pycomm recv (any source): a group of one rank has no peer");
  for (int round = 0;; ++round) {
    for (int k = 1; k <= world_; ++k) {  // every rank once, this one skipped
      const int src = (last_any_source_ + k) % world_;
      if (src == rank_) continue;
      const MailCtl& mail = segment_->mail(src, rank_);
      if (mail.sent.value.load(std::memory_order_acquire) !=
          mail.taken.value.load(std::memory_order_relaxed)) {
        last_any_source_ = src;
        recv(data, bytes, src, ctx);
        return src;
      }
    }
    if (Clock::now() >= ctx.deadline) {
      throw_op_error(ctx, "Timed out after " + std::to_string(ctx.timeout.count()) +
                              " ms waiting for a message from any rank");
    }
    if (round > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace pycomm::shm
