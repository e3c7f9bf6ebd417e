// Blocked reduction loops (see reduce_kernels.h): each block accumulates in registers-sized
// opmath arrays so the compiler vectorises the inner loops.
#include "shm/reduce_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace pycomm::shm {

namespace {

constexpr int64_t kBlock = 256;

template <typename T, typename Combine>
void reduce_loop(T* out, T* copy, const void* const* srcs, int nsrc, int64_t n, Combine combine,
                 at::opmath_type<T> scale, bool scaled) {
  using Acc = at::opmath_type<T>;
  Acc acc[kBlock];
  for (int64_t base = 0; base < n; base += kBlock) {
    int64_t len = std::min(kBlock, n - base);
    const T* first = static_cast<const T*>(srcs[0]) + base;
    for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<Acc>(first[i]);
    for (int s = 1; s < nsrc; ++s) {
      const T* src = static_cast<const T*>(srcs[s]) + base;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine(acc[i], static_cast<Acc>(src[i]));
    }
    if (scaled) {
      for (int64_t i = 0; i < len; ++i) acc[i] *= scale;
    }
    for (int64_t i = 0; i < len; ++i) out[base + i] = static_cast<T>(acc[i]);
    if (copy != nullptr) {
      for (int64_t i = 0; i < len; ++i) copy[base + i] = static_cast<T>(acc[i]);
    }
  }
}

template <typename T>
void reduce_typed(c10d::ReduceOp::RedOpType reduce, T* out, T* copy, const void* const* srcs,
                  int nsrc, int64_t n, int world) {
  using Acc = at::opmath_type<T>;
  switch (reduce) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
      return reduce_loop<T>(out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return a + b; },
                            static_cast<Acc>(1.0 / world), reduce == c10d::ReduceOp::AVG);
    case c10d::ReduceOp::PRODUCT:
      return reduce_loop<T>(out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return a * b; }, Acc(1),
                            false);
    case c10d::ReduceOp::MAX:
      return reduce_loop<T>(out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return b > a ? b : a; },
                            Acc(1), false);
    case c10d::ReduceOp::MIN:
      return reduce_loop<T>(out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return b < a ? b : a; },
                            Acc(1), false);
    default:
      TORCH_CHECK(false, "pycomm shm: unsupported reduce op ", static_cast<int>(reduce));
  }
}

bool supported_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf ||
         t == at::kInt || t == at::kLong;
}

}  // namespace

void check_reduction(const char* op, c10::ScalarType dtype, const c10d::ReduceOp& reduce) {
  TORCH_CHECK_VALUE(supported_dtype(dtype), "pycomm ", op, ": dtype ", dtype,
                    " is not supported for reductions (float32, float64, bfloat16, float16, "
                    "int32, int64)");
  auto r = reduce.op_;
  TORCH_CHECK_VALUE(r == c10d::ReduceOp::SUM || r == c10d::ReduceOp::AVG ||
                        r == c10d::ReduceOp::PRODUCT || r == c10d::ReduceOp::MAX ||
                        r == c10d::ReduceOp::MIN,
                    "pycomm ", op, ": reduce op ", static_cast<int>(r),
                    " is not supported (sum, avg, product, max, min)");
  TORCH_CHECK_VALUE(r != c10d::ReduceOp::AVG || at::isFloatingType(dtype), "pycomm ", op,
                    ": ReduceOp.AVG needs a floating dtype, got ", dtype);
}

void reduce_buffers(c10::ScalarType dtype, c10d::ReduceOp::RedOpType reduce, void* out,
                    const void* const* srcs, int nsrc, int64_t n, int world, void* copy) {
  if (n == 0) return;
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "pycomm_shm_reduce", [&] {
    reduce_typed<scalar_t>(reduce, static_cast<scalar_t*>(out), static_cast<scalar_t*>(copy),
                           srcs, nsrc, n, world);
  });
}

}  // namespace pycomm::shm
