// Mapping, sizing and unlinking of a group's segment (see Note [Segment layout]).
#include "shm/segment.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

namespace pycomm::shm {

namespace {

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

constexpr size_t kPage = 4096;

}  // namespace

Segment::Segment(const std::string& name, int rank, int world, size_t slot_bytes,
                 size_t mailbox_bytes, bool create)
    : world_(world),
      slot_bytes_(round_up(slot_bytes, kPage)),
      mailbox_bytes_(round_up(mailbox_bytes, kPage)) {
  // Owner-only: no other user may read the tensors that pass through.
  int flags = create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR;
  int fd = shm_open(name.c_str(), flags, 0600);
  TORCH_CHECK(fd >= 0, "pycomm shm: rank ", rank, " cannot ", create ? "create" : "open",
              " segment ", name, ": ", std::strerror(errno));
  mapped_bytes_ = total_bytes();
  if (create && ftruncate(fd, static_cast<off_t>(mapped_bytes_)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "pycomm shm: cannot size segment ", name, " to ", mapped_bytes_,
                " bytes: ", std::strerror(err));
  }
  // Note [Reserving the segment]
  // ftruncate only sets the size of a tmpfs file; its pages are allocated when first
  // touched, and a touch that finds /dev/shm full kills the process with SIGBUS (no error
  // to catch: MAP_POPULATE below fails silently). Containers often mount a small /dev/shm
  // (Docker's default: 64 MB). posix_fallocate makes the filesystem allocate every page
  // now, or fail with ENOSPC here, where it can be reported; the peers then map pages that
  // exist. pycomm.shm turns this error into a fallback or a clear error on every rank.
  if (create) {
    int err = posix_fallocate(fd, 0, static_cast<off_t>(mapped_bytes_));
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      TORCH_CHECK(false, kNoSpaceMessage, ": the group's segment needs ", mapped_bytes_,
                  " bytes for ", world,
                  " ranks and /dev/shm cannot hold them (posix_fallocate: ", std::strerror(err),
                  ")");
    }
  }
  // MAP_POPULATE: the page faults of first touch are taken here, not in the first operations.
  void* p = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED && create) shm_unlink(name.c_str());
  TORCH_CHECK(p != MAP_FAILED, "pycomm shm: rank ", rank, " cannot map segment ", name, " (",
              mapped_bytes_, " bytes): ", std::strerror(err));
  base_ = static_cast<char*>(p);
  if (create) initialise();
  auto* header = reinterpret_cast<Header*>(base_);
  TORCH_CHECK(header->magic == kMagic && header->world == world &&
                  header->slot_bytes == slot_bytes_ && header->mailbox_bytes == mailbox_bytes_,
              "pycomm shm: segment ", name, " does not match this group (world ", world, ")");
  this->rank(rank).pid.store(static_cast<int32_t>(getpid()));
}

Segment::~Segment() {
  if (base_ != nullptr) munmap(base_, mapped_bytes_);
}

void Segment::unlink(const std::string& name) { shm_unlink(name.c_str()); }

void Segment::initialise() {
  // The pages of a fresh segment are zero; construct the atomics in place all the same.
  auto* header = new (base_) Header{};
  for (int r = 0; r < world_; ++r) new (&rank(r)) RankCtl{};
  for (int s = 0; s < world_; ++s)
    for (int d = 0; d < world_; ++d) new (&mail(s, d)) MailCtl{};
  header->world = world_;
  header->slot_bytes = slot_bytes_;
  header->mailbox_bytes = mailbox_bytes_;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  header->magic = kMagic;
}

size_t Segment::ctl_offset() const { return round_up(sizeof(Header), kCacheLine); }
size_t Segment::mail_offset() const { return ctl_offset() + world_ * sizeof(RankCtl); }
size_t Segment::slots_offset() const {
  return round_up(mail_offset() + world_ * world_ * sizeof(MailCtl), kPage);
}
size_t Segment::mailboxes_offset() const {
  return slots_offset() + static_cast<size_t>(world_) * kSlotsPerRank * slot_bytes_;
}
size_t Segment::total_bytes() const {
  return mailboxes_offset() + static_cast<size_t>(world_) * world_ * mailbox_bytes_;
}

RankCtl& Segment::rank(int r) const {
  return *reinterpret_cast<RankCtl*>(base_ + ctl_offset() + r * sizeof(RankCtl));
}
MailCtl& Segment::mail(int src, int dst) const {
  return *reinterpret_cast<MailCtl*>(base_ + mail_offset() +
                                     (src * world_ + dst) * sizeof(MailCtl));
}
char* Segment::slot(int r, int index) const {
  return base_ + slots_offset() + (static_cast<size_t>(r) * kSlotsPerRank + index) * slot_bytes_;
}
char* Segment::mailbox(int src, int dst) const {
  return base_ + mailboxes_offset() + static_cast<size_t>(src * world_ + dst) * mailbox_bytes_;
}

}  // namespace pycomm::shm
