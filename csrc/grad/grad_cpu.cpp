// CPU kernels of the fused gradient ops: at::vec inner loops, at::parallel_for over
// fixed-size chunks (so the result does not depend on the thread count).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "grad/grad_math.h"

namespace pycomm {
namespace {

// Elements per reduction chunk: large enough to amortize a task, small enough that two
// cores both get work on a 1 MiB gradient bucket.
constexpr int64_t kReduceChunk = 1 << 16;

template <typename T>
at::opmath_type<T> sum_squares_chunk(const T* p, int64_t n) {
  using Acc = at::opmath_type<T>;
  using Vec = at::vec::Vectorized<Acc>;
  int64_t i = 0;
  Vec acc0(Acc(0)), acc1(Acc(0));
  if constexpr (std::is_same_v<T, Acc>) {
    for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {
      const Vec a = Vec::loadu(p + i), b = Vec::loadu(p + i + Vec::size());
      acc0 = at::vec::fmadd(a, a, acc0);
      acc1 = at::vec::fmadd(b, b, acc1);
    }
  } else {
    using LowVec = at::vec::Vectorized<T>;
    for (; i + LowVec::size() <= n; i += LowVec::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(LowVec::loadu(p + i));
      acc0 = at::vec::fmadd(a, a, acc0);
      acc1 = at::vec::fmadd(b, b, acc1);
    }
  }
  Acc total = at::vec::vec_reduce_all<Acc>(
      [](const Vec& x, const Vec& y) { return x + y; }, acc0 + acc1);
  for (; i < n; ++i) total = square_acc<T>(total, p[i]);
  return total;
}

at::Tensor sum_squares_cpu(const at::Tensor& x) {
  check_flat_floating(x, "pycomm::sum_squares", "x");
  auto out = at::empty({}, x.options().dtype(reduction_dtype(x)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sum_squares_cpu", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    const int64_t n = x.numel();
    const int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
    std::vector<Acc> partial(static_cast<size_t>(chunks), Acc(0));
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t lo = c * kReduceChunk;
        partial[c] = sum_squares_chunk<scalar_t>(p + lo, std::min(kReduceChunk, n - lo));
      }
    });
    Acc total(0);
    for (Acc v : partial) total += v;
    *out.mutable_data_ptr<Acc>() = total;
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("sum_squares", &sum_squares_cpu);
}

}  // namespace pycomm
