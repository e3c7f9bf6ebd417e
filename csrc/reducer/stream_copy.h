// The gradient copies of the reducer with non-temporal stores. See Note [Streaming copies]
// in stream_copy.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace pycomm::reducer {

// Destinations smaller than this are copied by ATen: they may still be in cache when read.
constexpr int64_t kStreamCopyMinBytes = 256 * 1024;

// dst = src (* float(scale)) for contiguous float32 CPU tensors of the same size, at least
// kStreamCopyMinBytes, that do not overlap, written with non-temporal stores; bitwise what
// at::mul_out(dst, src, scale) / dst.copy_(src) give. Returns false, touching nothing,
// where that does not apply (other dtype, device or layout, small, no SSE2): the caller
// copies with ATen then.
bool stream_copy(const at::Tensor& dst, const at::Tensor& src, std::optional<double> scale);

}  // namespace pycomm::reducer
