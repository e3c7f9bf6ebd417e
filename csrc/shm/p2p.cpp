// send/recv through the per-pair mailboxes of the segment. A mailbox holds one chunk: the
// sender waits until the receiver has taken the previous one, so a message that fits in
// one chunk completes without the receiver, and a longer one streams through.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

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

}  // namespace pycomm::shm
