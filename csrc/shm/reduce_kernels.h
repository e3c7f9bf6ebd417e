// Element-wise reduction of several equally long buffers into one: the arithmetic of the
// shared-memory collectives, separate from their data movement. Low-precision floats
// accumulate in float32 (at::opmath_type) and round once.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>

namespace pycomm::shm {

// Throw a ValueError naming `op` unless `dtype` and `reduce` are supported.
void check_reduction(const char* op, c10::ScalarType dtype, const c10d::ReduceOp& reduce);

// out[i] = reduce(srcs[0][i], ..., srcs[nsrc-1][i]) for i < n, divided by `world` for AVG,
// also stored to `copy` when it is not null (a second destination for free while the
// result is in registers). `out` may alias one of `srcs`; `copy` may not.
void reduce_buffers(c10::ScalarType dtype, c10d::ReduceOp::RedOpType reduce, void* out,
                    const void* const* srcs, int nsrc, int64_t n, int world, void* copy = nullptr);

// out[i] = srcs[0][i] + ... + srcs[nsrc-1][i], in that order, with srcs[scaled][i]
// multiplied by `scale` (rounded) before it is added: the sum that reduce_buffers gives when
// that source was pre-scaled with scale_copy, without the pre-scaled copy. Also stored to
// `copy` when it is not null. float32 and float64; `out` may alias srcs[scaled].
void sum_scaling_one(c10::ScalarType dtype, void* out, const void* const* srcs, int nsrc, int64_t n,
                     int scaled, double scale, void* copy);

// dst[i] = src[i] * scale for i < n, the multiply in `dtype` (scale rounded to it once):
// float32 and float64 only. A plain copy when scale is 1.
void scale_copy(c10::ScalarType dtype, void* dst, const void* src, int64_t n, double scale);

}  // namespace pycomm::shm
