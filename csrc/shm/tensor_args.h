// Argument checks and contiguous stand-ins shared by the entry points of ShmBackend
// (backend.cpp, backend_tensor_lists.cpp). Every failed check is a c10::ValueError
// (ValueError in Python) that names the operation.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace pycomm::shm {

inline void check_dense(const char* op, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.layout() == at::kStrided, "pycomm ", op,
                    ": needs dense CPU tensors, got a ", t.layout(), " tensor on ", t.device());
}

inline const at::Tensor& single(const char* op, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "pycomm ", op, ": expects one tensor per call, got ",
                    tensors.size());
  check_dense(op, tensors[0]);
  return tensors[0];
}

inline void check_rank(const char* op, const char* what, int64_t r, int world) {
  TORCH_CHECK_VALUE(r >= 0 && r < world, "pycomm ", op, ": ", what, " ", r,
                    " is outside the group (size ", world, ")");
}

inline void check_like(const char* op, const at::Tensor& t, const at::Tensor& like, int64_t numel) {
  check_dense(op, t);
  TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type() && t.numel() == numel, "pycomm ", op,
                    ": expected a ", like.scalar_type(), " tensor of ", numel, " elements, got ",
                    t.scalar_type(), " with ", t.numel());
}

// Whether any two of `tensors` share a byte of memory (their data spans, in bytes).
inline bool any_overlap(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  spans.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (t.nbytes() == 0) continue;
    const auto lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    spans.emplace_back(lo, lo + t.nbytes());
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return true;
  }
  return false;
}

// A contiguous stand-in for a user tensor, copied back by write_back() when it differs.
struct Dense {
  at::Tensor user, work;
  explicit Dense(const at::Tensor& t) : user(t), work(t.is_contiguous() ? t : t.contiguous()) {}
  char* data() const { return static_cast<char*>(work.data_ptr()); }
  size_t bytes() const { return work.nbytes(); }
  void write_back() {
    if (!work.is_same(user)) user.copy_(work);
  }
};

// Dense stand-ins for a list of tensors, and their data pointers in order.
struct DenseList {
  std::vector<Dense> dense;
  std::vector<char*> ptrs;
  explicit DenseList(const std::vector<at::Tensor>& tensors) {
    dense.reserve(tensors.size());
    for (const auto& t : tensors) {
      dense.emplace_back(t);
      ptrs.push_back(dense.back().data());
    }
  }
  std::vector<const char*> const_ptrs() const { return {ptrs.begin(), ptrs.end()}; }
  void write_back() {
    for (auto& d : dense) d.write_back();
  }
};

}  // namespace pycomm::shm
