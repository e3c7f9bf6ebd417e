// A list of tensors cut into tiles whose table lives on the device, built once per list and
// reused: what lets a clip pass over 1,000 gradients be one launch that a CUDA graph can
// capture. See Note [Tile plans].
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

#include "grad/span_list.h"

namespace pycomm {

// Elements per tile: 64 KiB of float32, a few waves of 16-byte loads for 256 threads.
constexpr int32_t kTileElements = 1 << 14;

// The element types a tile can hold (the kernels switch on it per tile).
enum class TileDtype : int32_t { kFloat = 0, kHalf = 1, kBFloat16 = 2, kDouble = 3 };

// One tile: `n` elements (1..kTileElements) of `dtype` from `ptr`. Sixteen bytes.
struct Tile {
  uint64_t ptr;
  int32_t n;
  int32_t dtype;
};
static_assert(sizeof(Tile) == 16, "a tile entry is one 16-byte load");

// A list's tiles on the device, and the workspace its norm pass reduces through.
struct TilePlan {
  c10::Device device{c10::kCUDA};
  at::Tensor tiles;      // int64 [2 * count]: the Tile entries
  at::Tensor partials;   // acc_dtype [2 * blocks]: each block's (acc, nonfinite)
  at::Tensor result;     // acc_dtype [2]: the eager clip's norm partial
  at::Tensor counter;    // int32 [1]: blocks done, zero between passes (the last resets it)
  int64_t count = 0;     // tiles
  int blocks = 0;        // blocks of the norm pass (a fixed number: a fixed summation order)
  at::ScalarType acc_dtype = at::kFloat;  // float64 when the list holds float64, else float32
  bool filled_in_graph = false;  // its table was written by a captured launch only
  bool pinned = false;           // used under capture: a graph reads it, never evicted
};

// The plan of `spans` (all on `device`, one of them at least), its norm accumulated in
// `acc` (float32, or float64): the cached one when the same spans (pointers, sizes, dtypes)
// were planned before, else a new one; `cache` false for spans that will not come again
// (temporary copies): planned, not kept.
std::shared_ptr<TilePlan> tile_plan(const SpanList& spans, c10::Device device, at::ScalarType acc,
                                    bool cache);

}  // namespace pycomm
