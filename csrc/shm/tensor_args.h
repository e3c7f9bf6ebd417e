// Argument checks and contiguous stand-ins shared by the entry points of ShmBackend
// (backend.cpp, backend_tensor_lists.cpp). Every failed check is a c10::ValueError
// (ValueError in Python) that names the operation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
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

// The dtype of `tensors` after checking them as pieces of one buffer (See Note [Pieces
// all-reduce]): defined, dense, of one dtype (float32 or float64), not sharing memory.
inline c10::ScalarType check_pieces(const char* op, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK_VALUE(!tensors.empty(), "pycomm ", op, ": no tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].defined(), "pycomm ", op, ": tensor ", i, " is undefined");
  }
  const c10::ScalarType dtype = tensors.front().scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble, "pycomm ", op,
                    ": float32 or float64 tensors, got ", dtype);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    check_dense(op, t);
    TORCH_CHECK_VALUE(t.scalar_type() == dtype, "pycomm ", op, ": tensor ", i, " is ",
                      t.scalar_type(), ", tensor 0 is ", dtype);
    TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense(), "pycomm ", op, ": tensor ", i,
                      " is not dense (strides ", t.strides(), " for sizes ", t.sizes(), ")");
    TORCH_CHECK_VALUE(!t.is_neg() && !t.is_conj(), "pycomm ", op, ": tensor ", i,
                      " is a lazily negated or conjugated view; resolve it first");
  }
  TORCH_CHECK_VALUE(!any_overlap(tensors), "pycomm ", op, ": two of the tensors share memory");
  return dtype;
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

// Note [Coalesced all-reduce]
// Gloo reduces all_reduce_coalesced's tensors as one flat copy and copies each result back,
// so every entry gets the reduction of the values the call started with, however the
// entries alias: a list holding one tensor twice (torch's own test input, 2 * [t]) is
// reduced once. Reducing the entries one after another in place reduced such a tensor
// twice: ranks holding 0 and 1 got 2 where Gloo gives 1, silently. So the entries of each
// dtype are packed into one buffer, reduced by one collective (one exchange for the list,
// not one per tensor), and copied back in list order, as Gloo copies them; a list of one
// tensor is reduced where it is (through its dense stand-in).
template <typename Reduce>
void reduce_coalesced(const std::vector<at::Tensor>& tensors, Reduce&& reduce) {
  if (tensors.size() == 1) {
    Dense d(tensors[0]);
    reduce(d.work);
    d.write_back();
    return;
  }
  std::vector<at::ScalarType> dtypes;  // first-seen order: the same on every rank
  for (const auto& t : tensors) {
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end())
      dtypes.push_back(t.scalar_type());
  }
  for (const at::ScalarType dtype : dtypes) {
    std::vector<at::Tensor> parts;
    std::vector<size_t> which;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].scalar_type() != dtype) continue;
      parts.push_back(tensors[i].reshape({-1}));
      which.push_back(i);
    }
    at::Tensor flat = at::cat(parts);
    reduce(flat);
    int64_t offset = 0;
    for (size_t i : which) {
      const at::Tensor& t = tensors[i];
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace pycomm::shm
