// The per-element math and the argument checks of the fused gradient kernels, written
// once and included by both the CPU and the CUDA backend. No loops, no launches here.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

namespace pycomm {

// Accumulate in at::opmath_type<T> (float for half/bfloat16), as torch's norms do.
template <typename T, typename Acc = at::opmath_type<T>>
C10_HOST_DEVICE inline Acc square_acc(Acc acc, T x) {
  const Acc v = static_cast<Acc>(x);
  return acc + v * v;
}

// The dtype a reduction over `x` returns: opmath for low precision, else x's own.
inline at::ScalarType reduction_dtype(const at::Tensor& x) {
  return at::toOpMathType(x.scalar_type());
}

inline void check_flat_floating(const at::Tensor& x, const char* op, const char* arg) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": ", arg,
              " must be a floating-point tensor, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": ", arg,
              " must be contiguous (pycomm kernels work on flat buffers); call .contiguous()");
}

}  // namespace pycomm
