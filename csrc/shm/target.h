// Channel::Target, where the elements of a reducing collective live (allreduce.cpp,
// collectives.cpp): the Channel's implementation files share it; nothing else includes it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstring>

#include "shm/collectives.h"
#include "shm/reduce_kernels.h"

namespace pycomm::shm {

// Where a collective's elements live: one buffer, or pieces read scaled and written back
// (Channel::allreduce_pieces). Byte offsets are from the start of the whole.
struct Channel::Target {
  char* data;
  const Pieces* pieces;
  c10::ScalarType dtype;
  double scale;

  // to[0, len) = the elements at [at, at + len), scaled (pieces) or as they are (data).
  void take(char* to, size_t at, size_t len) const {
    if (pieces == nullptr) {
      std::memcpy(to, data + at, len);
      return;
    }
    const size_t elem = c10::elementSize(dtype);
    pieces->each(at, len, [&](char* piece, size_t off, size_t n) {
      scale_copy(dtype, to + off, piece, static_cast<int64_t>(n / elem), scale);
    });
  }
  // The elements at [at, at + len) = from[0, len).
  void put(size_t at, const char* from, size_t len) const {
    if (pieces == nullptr) {
      std::memcpy(data + at, from, len);
      return;
    }
    pieces->each(at, len,
                 [&](char* piece, size_t off, size_t n) { std::memcpy(piece, from + off, n); });
  }
};

}  // namespace pycomm::shm
