// Symmetric buffers: memory that every rank of a group allocates together, each its own
// file in /dev/shm mapped by all the others, so that an all-reduce of a tensor living
// there reads the peers' values where they lie (See Note [Symmetric buffers]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pycomm::shm {

// Note [Symmetric buffers]
// A gradient bucket in private memory costs the shared-memory all-reduce two passes over
// the bucket besides the arithmetic: its parts are copied into the segment for the peers
// to read, and the peers' results copied back out of it (Note [All-reduce paths]). When
// the bucket itself lives in memory the peers have mapped, neither copy is needed: each
// rank reduces its part of the bucket from every rank's copy of it, in place, and then
// copies the other parts' results from their owners. At two ranks that moves 1.5 bytes
// read and 1 written per byte of bucket instead of 2 and 2.
//
// Allocation is collective: every rank asks for an arena of the same size at the same
// point of its program (the reducer builds the same buckets on every rank, at construction
// and at the one rebuild), queued on the collectives' lane like any collective. Each rank
// creates, sizes (posix_fallocate: tmpfs space is reserved now, not found missing at a
// page fault later) and maps its own file, the ranks exchange whether that worked, each
// maps the others' files, they exchange again, and each removes its own name: from then
// on only the mappings keep the memory, and it goes when the last of them does. Where any
// rank fails (/dev/shm full, a file-size limit), every rank drops what it made and the
// caller falls back to private memory: the answer is the same on every rank.
//
// An arena lives as long as the tensors cut from it (each holds a reference), independently
// of the group: gradients that are bucket views stay valid after the group is destroyed.
// The all-reduce recognises an arena tensor by its address, and trusts that every rank
// passes the tensor at the same offset of the same arena (the reducer does: same buckets in
// the same order); it checks that before reading, and a mismatch is an error naming both
// ranks, not a silent wrong sum.
class Arena {
 public:
  Arena(uint64_t id, size_t bytes, int rank, int world)
      : id_(id), bytes_(bytes), rank_(rank), bases_(world, nullptr) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  uint64_t id() const { return id_; }
  size_t bytes() const { return bytes_; }
  char* mine() const { return bases_[rank_]; }
  char* base(int rank) const { return bases_[rank]; }
  // Where [p, p + n) lies in this rank's arena, or -1.
  int64_t offset_of(const void* p, size_t n) const;

  // Create (owner) or open (peer) the file `name` of `bytes` and map it as rank `r`'s.
  // False with `why` set on failure; nothing is left behind by a failed create.
  bool map(int r, const std::string& name, bool create, std::string& why);

 private:
  uint64_t id_;
  size_t bytes_;
  int rank_;
  std::vector<char*> bases_;
};

// The name of rank `rank`'s file of arena `id` in the group whose segment is `segment`.
std::string arena_name(const std::string& segment, uint64_t id, int rank);

}  // namespace pycomm::shm
