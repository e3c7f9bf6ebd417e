// How a flat run of elements is cut among the ranks of a group: one rule for every part
// of pycomm that cuts one.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace pycomm::comm {

// Note [Equal ranges and a tail]
// n elements over `world` ranks: rank r's range is [r * range, (r + 1) * range) with
// range = n / world, and the n mod world elements left after the last range are the tail.
// Equal ranges are what the tensor forms of reduce-scatter and all-gather move, on the
// buffer itself with no padding copy; the tail (fewer than `world` elements) is handled
// apart. The pieces reduce-scatter (ShmBackend::reduce_scatter_pieces) all-reduces it into
// place after the ranges; the sharded optimizer (pycomm/zero/layout.py, through
// _C.shard_split) gives it to the last rank, which steps and broadcasts it.
struct ShardSplit {
  int64_t range;
  int64_t tail;
};

inline ShardSplit shard_split(int64_t n, int64_t world) {
  TORCH_CHECK_VALUE(world > 0 && n >= 0, "shard_split: ", n, " elements over ", world,
                    " ranks (need n >= 0 and world > 0)");
  const int64_t range = n / world;
  return {range, n - range * world};
}

}  // namespace pycomm::comm
