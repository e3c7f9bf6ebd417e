// What a gradient all-reduce sends across a host boundary (DDPConfig.wire and
// DDPConfig.wire_error_feedback), as one value the reducer hands to the backend whole.
// See Note [Low-precision wire] in shm/wire_codec.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace pycomm::comm {

enum class WireDtype : int8_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2 };

struct Wire {
  WireDtype dtype = WireDtype::kFloat32;
  bool error_feedback = false;

  // DDPConfig's spelling: wire is "fp32", "bf16" or "int8"; error_feedback needs "int8".
  // Anything else is a ValueError naming the option and what it accepts.
  static Wire parse(const std::string& wire, bool error_feedback);
  // "fp32", "bf16", "int8", or "int8+ef" with error feedback.
  std::string name() const;
  // fp32: the wire carries the gradients' own float32 values (today's all-reduce).
  bool exact() const { return dtype == WireDtype::kFloat32; }
};

// The error-feedback residuals of one tensor's wire all-reduces (a DDP bucket's), kept by
// whoever issues them from one step to the next; the backend sizes and updates them.
// `sent`: what the wire lost of this rank's share of the tensor when it sent it;
// `summed`: what it lost of the sums this rank formed and sent back. Zeros at first, and
// again whenever the tensor's size or the group's shape changes.
struct WireResidual {
  std::mutex mutex;  // one all-reduce of the tensor at a time reads and writes them
  at::Tensor sent, summed;
  // The layout they were made for (the backend's: blocks, elements per rank's piece,
  // hosts); another layout starts them again from zero.
  std::vector<int64_t> layout;
};

}  // namespace pycomm::comm
