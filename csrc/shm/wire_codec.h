// The wire forms of float32 gradients (DDPConfig.wire): what the hierarchical all-reduce
// sends across hosts, and how it reads back what came across.
#pragma once

#include <cstdint>

#include "comm/wire.h"

namespace pycomm::shm {

// Note [Low-precision wire]
// Across hosts a DDP step is bound by the link, and gradients tolerate a coarser format on
// the way if the sums stay exact. With DDPConfig(wire="bf16" | "int8") the hierarchical
// all-reduce (Note [Hierarchical all-reduce] in hier.h) keeps its shared-memory phases in
// float32 and replaces its cross-host all-reduce of each rank's piece by:
//   1. the piece cut into H chunks (one per host, the last padded), each encoded on its
//      own; an all-to-all over the cross group gives every rank the H encodings of the
//      chunk it owns;
//   2. the owner decodes them and adds them in float32, in host order: no partial sum is
//      ever rounded to the wire's precision (torch's bf16_compress_hook rounds every one,
//      so its error grows with the ranks);
//   3. the owner encodes the sum once, and an all-gather over the cross group gives every
//      rank every chunk's encoded sum, which each decodes into its piece, the owner too.
//      So the all-gather carries the wire format, not float32: float32 there would cost
//      (2 + 4) / (4 + 4) = 0.75 of today's bytes for bf16, and every rank reads the same
//      bytes, so every rank of the group ends with the same bits.
// Bytes out of a host, against the float32 all-reduce's 2 (H-1)/H x 4 per element: bf16
// sends 2 + 2 (0.5x); int8 1 + 1 plus a float32 scale per kInt8Block elements (0.254x).
// The reduce-scatter (a sharded optimizer's released buckets: Note [Hierarchical
// reduce-scatter and all-gather] in hier.h) has step 1 only: its all-to-all carries each
// host's sums of the H ranges, each range encoded on its own, and each rank decodes the H
// encodings of its own range and adds them in float32, in host order. Nothing comes back,
// so its gradients are rounded once; each rank ends with its own range, as in float32.
// int8 is symmetric, per block of kInt8Block elements: scale = max|x| / 127, q = x / scale
// rounded to nearest even, so a block's largest element maps to +-127 and every element
// decodes within scale / 2 (plus the float rounding of q x scale). The block is 256 elements (1 KiB
// of float32), the knee measured on real gradients (benchmarks/results/wire_accuracy_cpu.md, one
// encoding's relative L2 error, a char LM's / the bench transformer's): 64 elements 6.1e-3 / 7.9e-3
// at 1.0625 bytes an element, 256 8.3e-3 / 9.3e-3 at 1.0156, 1,024 1.4e-2 / 1.4e-2 at 1.0039.
// Smaller blocks buy little accuracy for 4.6% more bytes; larger ones let one large value flatten
// more of its neighbours (a tensor boundary inside a block costs the smaller tensor precision).
// Error feedback (wire_error_feedback, int8 only): what encoding loses, x - decoded(x), is
// kept per rank and added to the next step's value before it is encoded, both for the
// rank's share it sends (step 1) and for the sums it owns (step 3; the reduce-scatter has
// none): over steps the losses cancel instead of adding up. Residuals live with the caller
// (comm::WireResidual, one per DDP bucket) and restart at zero when the bucket changes. Non-finite
// values: bf16 keeps inf and nan; an int8 block holding one decodes as nan throughout (a GradScaler
// still sees it and skips the step), and leaves its residuals as they were.

// Elements per int8 scale.
constexpr int64_t kInt8Block = 256;

// Bytes `n` float32 values take in `dtype`'s wire form (a multiple of 4).
int64_t wire_bytes(comm::WireDtype dtype, int64_t n);

// dst <- the wire form of src[0, n). With `residual` (int8 only): src[i] + residual[i] is
// encoded, and residual[i] becomes what the encoding lost of it.
void wire_encode(comm::WireDtype dtype, const float* src, int64_t n, uint8_t* dst, float* residual);

// out[0, n) = the values src encodes (add: out[i] += them, in float32).
void wire_decode(comm::WireDtype dtype, const uint8_t* src, int64_t n, float* out, bool add);

}  // namespace pycomm::shm
