// What the pipelines of HierBackend (hier.cpp, hier_allreduce.cpp) share: waiting for one
// phase with a failure that names the rank's place in the hierarchy.
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <exception>
#include <string>

namespace pycomm::shm {

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
