// What a gradient all-reduce sends across a host boundary (DDPConfig.wire and
// DDPConfig.wire_error_feedback), as one value the reducer hands to the backend whole.
// See Note [Low-precision wire] in shm/wire_codec.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace pycomm::comm {

enum class WireDtype : int8_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2 };

// Note [The wire as a value]
// A wire is parsed once, where the user names it (DDPConfig's wire and wire_error_feedback,
// or a string given to a backend's wire collective), into this value, which then travels
// whole: DDPConfig.wire_format -> the reducer's options -> its all-reduce hook -> the
// backend; and back to Python as pycomm.Wire (ddp.reducer.wire, None while a comm hook
// decides what crosses). The rules that depend on the wire alone live here: its names, and
// which gradient dtypes it encodes.
struct Wire {
  WireDtype dtype = WireDtype::kFloat32;
  bool error_feedback = false;

  // DDPConfig's spelling: wire is "fp32", "bf16" or "int8"; error_feedback needs "int8".
  // Anything else is a ValueError naming the option and what it accepts.
  static Wire parse(const std::string& wire, bool error_feedback);
  // The same check for a wire given by its dtype.
  static Wire of(WireDtype dtype, bool error_feedback);
  // "fp32", "bf16", "int8", or "int8+ef" with error feedback.
  std::string name() const;
  // "fp32", "bf16" or "int8": the dtype's name alone.
  const char* dtype_name() const;
  // fp32: the wire carries the gradients' own float32 values (today's all-reduce).
  bool exact() const { return dtype == WireDtype::kFloat32; }
  // Whether gradients of `grad` dtype can cross in it: any on fp32; float32, bfloat16 and
  // float16 on a low-precision wire (it encodes from float32 sums).
  bool carries(at::ScalarType grad) const;
  // A ValueError unless carries(grad): "DDPConfig(wire='bf16') sends ... across hosts;
  // <what> (use wire='fp32' ...)", `what` naming the parameter or the bucket.
  void check_carries(at::ScalarType grad, const std::string& what) const;
  bool operator==(const Wire& other) const {
    return dtype == other.dtype && error_feedback == other.error_feedback;
  }
  bool operator!=(const Wire& other) const { return !(*this == other); }
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
