// The shared-memory segment of one pycomm process group: its layout, mapping and
// lifetime. Owns nothing about collectives (collectives.h) or waiting (sync.h).
//
// Note [Segment layout]
//   Header | RankCtl x world | MailCtl x world^2 | slots: world x kSlotsPerRank x slot_bytes
//          | mailboxes: world^2 x mailbox_bytes
// Each rank writes only its own RankCtl (its step counter, pid, and a tag per slot: Note
// [Collective identity] in collectives.cpp) and its own slots; every rank reads all of them.
// A mailbox (src -> dst) is written by src and read by dst (send/recv).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm::shm {

constexpr uint64_t kMagic = 0x70636f6d6d73686dULL;  // "pcommshm"
constexpr int kSlotsPerRank = 4;  // See Note [Step counters] and Note [All-reduce paths]
constexpr size_t kCacheLine = 64;
// The start of the error raised when /dev/shm cannot hold a new segment (See Note
// [Reserving the segment] in segment.cpp); pycomm.shm recognises it by this text.
constexpr const char* kNoSpaceMessage = "pycomm shm: no space in /dev/shm";

// A 32-bit word a futex can wait on, with a count of the ranks asleep on it, so that a
// writer only pays for FUTEX_WAKE when somebody sleeps.
struct alignas(kCacheLine) Signal {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;
  // When `value` was last stored (steady clock, ns: system-wide): tells a rank that slept
  // how long spinning would have taken (See Note [Adaptive spin]).
  std::atomic<int64_t> published_ns;
};

// What one round of a rank belongs to (See Note [Collective identity] in collectives.cpp):
// stored before the round's step is published, read by the peers once they have seen it.
struct OpTag {
  std::atomic<uint64_t> what;  // the collective's kind | dtype << 8
  std::atomic<int64_t> count;  // its elements (bytes, for data movement)
  std::atomic<int64_t> bucket;  // the caller's label (comm::OpLabel)
  std::atomic<int64_t> forwards;
  std::atomic<int64_t> step;
};

struct alignas(kCacheLine) RankCtl {
  Signal step;            // See Note [Step counters]
  std::atomic<int32_t> pid;
  std::atomic<int32_t> dumps_on_signal;  // 1: pycomm handles its SIGUSR2 (Note [Every rank dumps])
  OpTag tags[kSlotsPerRank];  // one per slot: a round's tag lives as long as its data
};

struct alignas(kCacheLine) MailCtl {
  Signal sent;  // chunks the sender has put in the mailbox
  Signal taken;  // chunks the receiver has copied out
  std::atomic<uint64_t> chunk_bytes;  // size of the chunk now in the mailbox
  std::atomic<uint64_t> total_bytes;  // size of the whole message it belongs to
};

struct alignas(kCacheLine) Header {
  uint64_t magic;
  int32_t world;
  uint64_t slot_bytes;
  uint64_t mailbox_bytes;
};

// A mapped segment. The creator (rank 0) sizes and initialises it; the others open it.
class Segment {
 public:
  Segment(const std::string& name, int rank, int world, size_t slot_bytes, size_t mailbox_bytes,
          bool create);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Remove the name from /dev/shm; the mapping lives on until every rank unmaps it.
  static void unlink(const std::string& name);

  int world() const { return world_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t mailbox_bytes() const { return mailbox_bytes_; }
  RankCtl& rank(int r) const;
  MailCtl& mail(int src, int dst) const;
  char* slot(int r, int index) const;
  char* mailbox(int src, int dst) const;

 private:
  size_t ctl_offset() const;
  size_t mail_offset() const;
  size_t slots_offset() const;
  size_t mailboxes_offset() const;
  size_t total_bytes() const;
  void initialise();

  int world_;
  size_t slot_bytes_;
  size_t mailbox_bytes_;
  char* base_ = nullptr;
  size_t mapped_bytes_ = 0;
};

}  // namespace pycomm::shm
