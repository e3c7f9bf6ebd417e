// See wire.h.
#include "comm/wire.h"

#include <c10/util/Exception.h>

namespace pycomm::comm {

Wire Wire::parse(const std::string& wire, bool error_feedback) {
  Wire w;
  if (wire == "fp32") {
    w.dtype = WireDtype::kFloat32;
  } else if (wire == "bf16") {
    w.dtype = WireDtype::kBFloat16;
  } else if (wire == "int8") {
    w.dtype = WireDtype::kInt8;
  } else {
    TORCH_CHECK_VALUE(false, "wire must be 'fp32', 'bf16' or 'int8' (what a gradient all-reduce ",
                      "sends across hosts), got '", wire, "'");
  }
  TORCH_CHECK_VALUE(!error_feedback || w.dtype == WireDtype::kInt8,
                    "wire_error_feedback needs wire='int8' (bf16 rounds each value to its ",
                    "nearest and keeps no residual), got wire='", wire, "'");
  w.error_feedback = error_feedback;
  return w;
}

Wire Wire::of(WireDtype dtype, bool error_feedback) {
  Wire w;
  w.dtype = dtype;
  return parse(w.dtype_name(), error_feedback);
}

const char* Wire::dtype_name() const {
  switch (dtype) {
    case WireDtype::kFloat32: return "fp32";
    case WireDtype::kBFloat16: return "bf16";
    case WireDtype::kInt8: return "int8";
  }
  return "?";
}

std::string Wire::name() const { return std::string(dtype_name()) + (error_feedback ? "+ef" : ""); }

bool Wire::carries(at::ScalarType grad) const {
  return exact() || grad == at::kFloat || grad == at::kBFloat16 || grad == at::kHalf;
}

void Wire::check_carries(at::ScalarType grad, const std::string& what) const {
  TORCH_CHECK_VALUE(carries(grad), "DDPConfig(wire='", dtype_name(), "') sends float32, ",
                    "bfloat16 and float16 gradients across hosts; ", what, " (use wire='fp32' ",
                    "for it)");
}

}  // namespace pycomm::comm
