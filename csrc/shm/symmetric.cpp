// Arenas of symmetric buffers: their files, mappings and the collective that makes them
// (See Note [Symmetric buffers]). The all-reduce over them is in allreduce.cpp.
#include "shm/symmetric.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shm/collectives.h"

namespace pycomm::shm {

Arena::~Arena() {
  for (char* base : bases_) {
    if (base != nullptr) munmap(base, bytes_);
  }
}

int64_t Arena::offset_of(const void* p, size_t n) const {
  const char* c = static_cast<const char*>(p);
  const char* mine = bases_[rank_];
  if (mine == nullptr || c < mine || c + n > mine + bytes_) return -1;
  return c - mine;
}

bool Arena::map(int r, const std::string& name, bool create, std::string& why) {
  auto fail = [&](const char* what, int err) {
    why = std::string(what) + " " + name + ": " + std::strerror(err);
    return false;
  };
  const int fd = shm_open(name.c_str(), create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
  if (fd < 0) return fail(create ? "cannot create" : "cannot open", errno);
  if (create) {
    // ftruncate alone would leave a hole that a full /dev/shm turns into SIGBUS at the first
    // write of a gradient: reserve the pages now, where failing is still an answer.
    int err = ftruncate(fd, static_cast<off_t>(bytes_)) == 0
                  ? posix_fallocate(fd, 0, static_cast<off_t>(bytes_))
                  : errno;
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      return fail("cannot size", err);
    }
  }
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    return fail("cannot map", err);
  }
  bases_[r] = static_cast<char*>(p);
  return true;
}

std::string arena_name(const std::string& segment, uint64_t id, int rank) {
  return segment + ".a" + std::to_string(id) + ".r" + std::to_string(rank);
}

namespace {

// What a rank tells the others in each round of map_arena, in its slot.
struct Offer {
  int32_t ok;
  uint64_t bytes;
  char why[240];
};

void write_offer(char* slot, bool ok, size_t bytes, const std::string& why) {
  auto* offer = reinterpret_cast<Offer*>(slot);
  offer->ok = ok ? 1 : 0;
  offer->bytes = bytes;
  const size_t n = std::min(why.size(), sizeof(offer->why) - 1);
  std::memcpy(offer->why, why.data(), n);
  offer->why[n] = '\0';
}

}  // namespace

std::shared_ptr<Arena> Channel::map_arena(const std::string& segment, uint64_t id, size_t bytes,
                                          std::string& why, const OpContext& ctx) {
  auto arena = std::make_shared<Arena>(id, bytes, rank_, world_);
  const std::string own = arena_name(segment, id, rank_);
  // A round: publish whether this rank's part worked, take a phase, and return the first
  // failing rank's reason ("" when every rank succeeded). Sizes must agree on every rank.
  auto round = [&](bool ok, const std::string& reason) -> std::string {
    write_offer(begin_round(), ok, bytes, reason);
    phase(ctx);
    std::string first;
    for (int p = 0; p < world_; ++p) {
      const auto* offer = reinterpret_cast<const Offer*>(p == rank_
                                                             ? segment_->slot(rank_, slot_index_)
                                                             : peer_slot(p));
      if (offer->bytes != bytes) {
        if (arena->mine() != nullptr) shm_unlink(own.c_str());
        TORCH_CHECK(false, "pycomm shm: symmetric buffers of ", bytes, " bytes asked for on rank ",
                    rank_, " but ", offer->bytes, " on rank ", p,
                    ": every rank must build the same buckets");
      }
      if (!offer->ok && first.empty()) first = "rank " + std::to_string(p) + ": " + offer->why;
    }
    return first;
  };
  std::string reason;
  bool ok = arena->map(rank_, own, /*create=*/true, reason);
  why = round(ok, reason);
  if (why.empty()) {
    for (int p = 0; p < world_ && ok; ++p) {
      if (p != rank_) ok = arena->map(p, arena_name(segment, id, p), /*create=*/false, reason);
    }
    why = round(ok, ok ? "" : reason);
  }
  // Every rank has mapped every file, or every rank gives up: the names can go either way.
  if (arena->mine() != nullptr) shm_unlink(own.c_str());
  return why.empty() ? arena : nullptr;
}

}  // namespace pycomm::shm
