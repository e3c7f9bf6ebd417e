// A list of tensors seen as one virtual concatenation of flat spans: what lets one kernel
// call (CPU) or one launch (CUDA) cover many tensors. Host-only bookkeeping shared by both
// backends; the element math lives in grad_math.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "grad/grad_math.h"

namespace pycomm {

struct Span {
  void* data;
  int64_t numel;
  at::ScalarType dtype;
  size_t index;  // position in the caller's list (pairs of lists share it)
};

struct SpanList {
  std::vector<Span> spans;
  std::vector<int64_t> begin{0};  // begin[s]: offset of spans[s] in the concatenation

  void add(void* data, int64_t numel, at::ScalarType dtype, size_t index) {
    if (numel == 0) return;  // empty tensors contribute nothing and take no chunk
    spans.push_back({data, numel, dtype, index});
    begin.push_back(begin.back() + numel);
  }
  int64_t total() const { return begin.back(); }
  void reserve(size_t n) {
    spans.reserve(n);
    begin.reserve(n + 1);
  }
};

// Calls f(span_position, offset_in_span, count) for every span piece inside [lo, hi).
template <typename F>
void for_each_piece(const SpanList& l, int64_t lo, int64_t hi, F&& f) {
  size_t s = std::upper_bound(l.begin.begin(), l.begin.end(), lo) - l.begin.begin() - 1;
  for (; s < l.spans.size() && l.begin[s] < hi; ++s) {
    const int64_t a = std::max(lo, l.begin[s]) - l.begin[s];
    const int64_t b = std::min(hi, l.begin[s + 1]) - l.begin[s];
    if (b > a) f(s, a, b - a);
  }
}

// The spans of a list to read. Tensors that are not one flat span (strided views) are read
// through a contiguous copy, kept alive in `copies`: a norm is order-independent, so any
// dense layout reads as-is and only real gaps cost a copy.
inline SpanList read_spans(at::TensorList ts, std::vector<at::Tensor>& copies) {
  SpanList l;
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor* t = &ts[i];
    if (!is_flat_span(*t)) {
      copies.push_back(t->contiguous());
      t = &copies.back();
    }
    l.add(const_cast<void*>(t->const_data_ptr()), t->numel(), t->scalar_type(), i);
  }
  return l;
}

// The spans of a list to write in place. Tensors that are not one flat span are left out
// and returned in `strided` (by index) for the caller's elementwise fallback.
inline SpanList write_spans(at::TensorList ts, std::vector<size_t>& strided) {
  SpanList l;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (is_flat_span(ts[i])) {
      l.add(ts[i].mutable_data_ptr(), ts[i].numel(), ts[i].scalar_type(), i);
    } else {
      strided.push_back(i);
    }
  }
  return l;
}

}  // namespace pycomm
