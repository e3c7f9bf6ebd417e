// What the pipelines of HierBackend (hier.cpp, hier_allreduce.cpp) share: the names a wire
// gives their operations, and waiting for one phase with a failure that names the rank's
// place in the hierarchy.
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <exception>
#include <string>
#include <utility>

#include "comm/wire.h"

namespace pycomm::shm {

// The names the shared-memory phases of a hierarchical all-reduce carry in errors and the
// flight record: the plain operations', or with the wire the all-reduce crosses hosts in.
inline std::pair<const char*, const char*> local_phase_names(const comm::Wire& wire) {
  switch (wire.dtype) {
    case comm::WireDtype::kFloat32: return {"reduce_scatter_tensor", "all_gather_into_tensor"};
    case comm::WireDtype::kBFloat16:
      return {"reduce_scatter_tensor[wire=bf16]", "all_gather_into_tensor[wire=bf16]"};
    case comm::WireDtype::kInt8:
      return wire.error_feedback ? std::make_pair("reduce_scatter_tensor[wire=int8+ef]",
                                                  "all_gather_into_tensor[wire=int8+ef]")
                                 : std::make_pair("reduce_scatter_tensor[wire=int8]",
                                                  "all_gather_into_tensor[wire=int8]");
  }
  return {"reduce_scatter_tensor", "all_gather_into_tensor"};
}

// The operation's name in errors and records: which wire it ran with.
inline const char* wire_op_name(const comm::Wire& wire) {
  switch (wire.dtype) {
    case comm::WireDtype::kFloat32: return "all_reduce";
    case comm::WireDtype::kBFloat16: return "all_reduce[wire=bf16]";
    case comm::WireDtype::kInt8:
      return wire.error_feedback ? "all_reduce[wire=int8+ef]" : "all_reduce[wire=int8]";
  }
  return "all_reduce";
}

// What a wire operation `op` takes: float32, bfloat16 or float16 tensors, and with error
// feedback a residual to keep; anything else is a ValueError naming the operation.
inline void check_wire(const char* op, const at::Tensor& t, const comm::Wire& wire,
                       bool has_residual) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "pycomm ",
                    op, ": the low-precision wire takes float32, bfloat16 or float16 tensors, got ",
                    dtype);
  TORCH_CHECK_VALUE(!wire.error_feedback || has_residual, "pycomm ", op,
                    ": error feedback needs a residual to keep");
}

// Wait for one phase of a hierarchical operation; a failure names the operation (with
// `detail`, e.g. the block), the rank's place in the hierarchy and the phase.
inline void wait_phase(const char* op, uint64_t seq, const std::string& detail, int rank, int host,
                       int hosts, const c10d::Backend& local, const char* what,
                       const c10::intrusive_ptr<c10d::Work>& w) {
  try {
    w->wait();
  } catch (const std::exception& e) {
    std::string why = e.what();
    if (auto* c = dynamic_cast<const c10::Error*>(&e)) why = c->what_without_backtrace();
    TORCH_CHECK_WITH(DistBackendError, false, "pycomm ", op, " #", seq, " (hierarchical", detail,
                     ") on rank ", rank, " (host ", host, " of ", hosts, ", local rank ",
                     local.getRank(), " of ", local.getSize(), "): ", what, " failed: ", why);
  }
}

}  // namespace pycomm::shm
