// Blocked reduction loops (see reduce_kernels.h): each block accumulates in registers-sized
// opmath arrays so the compiler vectorises the inner loops.
#include "shm/reduce_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "shm/lowp_convert.h"

namespace pycomm::shm {

namespace {

// Note [Reduction loops]
// These loops run at memory speed only when each element is loaded, combined and stored
// in one pass: a first version that staged every block through a stack array in four
// separate loops (load, combine, store, store the copy) took 2.0 ms for 8 MiB of float32
// at two sources where one fused loop takes 0.9 ms (this machine, one process). So:
// - two sources whose type is its own accumulator (float, double, integers): one fused
//   loop, straight from the sources to `out` (and `copy`);
// - otherwise blocks of kBlock elements accumulate in a register-sized opmath array
//   (fp32 for bf16/fp16, and a safe place while `out` aliases a later source), with the
//   first two sources combined in one loop and the result stored to `out` and `copy` in
//   one loop; bfloat16/float16 blocks convert to and from float32 through the vectorised
//   conversions of lowp_convert.h. A source that `out` aliases is read into the block
//   before `out` is written, so aliasing any source is safe. The sources are combined in the order
//   given (0, 1, ..., nsrc - 1; the callers list them in Gloo's order, Note [Gloo's
//   summation order] in sum_order.h), so every rank reducing the same buffers gets the
//   same bits. AVG divides the result by the world size, as Gloo's does.
constexpr int64_t kBlock = 512;

template <typename T>
constexpr bool kLowPrecision = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// AVG's last step, as Gloo's AVG takes it: the sum divided by the world size. By a power
// of two, a multiply by the reciprocal (exact) gives the same bits and saves the division,
// which at 3 ranks made an AVG all-reduce 3-11% slower than multiplying by 1/3 had, from
// 64 KiB to 16 MiB (float32, this machine, two interleaved A/B runs, 2026-11-27).
template <typename Acc>
struct DivideBy {
  Acc divisor;
  Acc operator()(Acc v) const { return v / divisor; }
};
template <typename Acc>
struct TimesExact {
  Acc reciprocal;
  Acc operator()(Acc v) const { return v * reciprocal; }
};
// The other ops: nothing after the combine.
struct AsIs {
  template <typename Acc>
  Acc operator()(Acc v) const {
    return v;
  }
};

template <typename T, typename Acc, typename Combine, typename Finish, bool kCopy>
void fused_pair(T* out, T* copy, const T* a, const T* b, int64_t n, Combine combine,
                Finish finish) {
  for (int64_t i = 0; i < n; ++i) {
    Acc v = finish(combine(static_cast<Acc>(a[i]), static_cast<Acc>(b[i])));
    out[i] = static_cast<T>(v);
    if constexpr (kCopy) copy[i] = static_cast<T>(v);
  }
}

template <typename T, typename Combine, typename Finish>
void reduce_loop(T* out, T* copy, const void* const* srcs, int nsrc, int64_t n, Combine combine,
                 Finish finish) {
  using Acc = at::opmath_type<T>;
  auto src = [&](int s) { return static_cast<const T*>(srcs[s]); };
  if (std::is_same_v<Acc, T> && nsrc == 2) {
    copy
        ? fused_pair<T, Acc, Combine, Finish, true>(out, copy, src(0), src(1), n, combine, finish)
        : fused_pair<T, Acc, Combine, Finish, false>(out, copy, src(0), src(1), n, combine, finish);
    return;
  }
  Acc acc[kBlock];
  [[maybe_unused]] Acc next[kBlock];
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t len = std::min(kBlock, n - base);
    T* o = out + base;
    if constexpr (kLowPrecision<T>) {
      to_float(src(0) + base, acc, len);
      for (int s = 1; s < nsrc; ++s) {
        to_float(src(s) + base, next, len);
        for (int64_t i = 0; i < len; ++i) acc[i] = combine(acc[i], next[i]);
      }
      if constexpr (!std::is_same_v<Finish, AsIs>) {
        for (int64_t i = 0; i < len; ++i) acc[i] = finish(acc[i]);
      }
      from_float(acc, o, len);
      if (copy != nullptr) std::memcpy(copy + base, o, len * sizeof(T));
      continue;
    }
    const T* first = src(0) + base;
    if (nsrc >= 2) {
      const T* second = src(1) + base;
      for (int64_t i = 0; i < len; ++i) {
        acc[i] = combine(static_cast<Acc>(first[i]), static_cast<Acc>(second[i]));
      }
    } else {
      for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<Acc>(first[i]);
    }
    for (int s = 2; s < nsrc; ++s) {
      const T* more = src(s) + base;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine(acc[i], static_cast<Acc>(more[i]));
    }
    if constexpr (!std::is_same_v<Finish, AsIs>) {
      for (int64_t i = 0; i < len; ++i) acc[i] = finish(acc[i]);
    }
    if (copy != nullptr) {
      T* c = copy + base;
      for (int64_t i = 0; i < len; ++i) o[i] = c[i] = static_cast<T>(acc[i]);
    } else {
      for (int64_t i = 0; i < len; ++i) o[i] = static_cast<T>(acc[i]);
    }
  }
}

template <typename T>
void reduce_typed(c10d::ReduceOp::RedOpType reduce, T* out, T* copy, const void* const* srcs,
                  int nsrc, int64_t n, int world) {
  using Acc = at::opmath_type<T>;
  auto sum = [](Acc a, Acc b) { return a + b; };
  switch (reduce) {
    case c10d::ReduceOp::SUM: return reduce_loop<T>(out, copy, srcs, nsrc, n, sum, AsIs{});
    case c10d::ReduceOp::AVG:
      if ((world & (world - 1)) == 0) {
        return reduce_loop<T>(out, copy, srcs, nsrc, n, sum,
                              TimesExact<Acc>{static_cast<Acc>(1.0 / world)});
      }
      return reduce_loop<T>(out, copy, srcs, nsrc, n, sum, DivideBy<Acc>{static_cast<Acc>(world)});
    case c10d::ReduceOp::PRODUCT:
      return reduce_loop<T>(out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return a * b; }, AsIs{});
    case c10d::ReduceOp::MAX:
      return reduce_loop<T>(
          out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return b > a ? b : a; }, AsIs{});
    case c10d::ReduceOp::MIN:
      return reduce_loop<T>(
          out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return b < a ? b : a; }, AsIs{});
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      if constexpr (std::is_integral_v<T>) {  // check_reduction lets integers alone through
        if (reduce == c10d::ReduceOp::BAND)
          return reduce_loop<T>(
              out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return a & b; }, AsIs{});
        if (reduce == c10d::ReduceOp::BOR)
          return reduce_loop<T>(
              out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return a | b; }, AsIs{});
        return reduce_loop<T>(out, copy, srcs, nsrc, n, [](Acc a, Acc b) { return a ^ b; }, AsIs{});
      }
      [[fallthrough]];
    default: TORCH_CHECK(false, "pycomm shm: unsupported reduce op ", static_cast<int>(reduce));
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
  const bool bitwise = r == c10d::ReduceOp::BAND || r == c10d::ReduceOp::BOR ||
                       r == c10d::ReduceOp::BXOR;
  TORCH_CHECK_VALUE(r == c10d::ReduceOp::SUM || r == c10d::ReduceOp::AVG ||
                        r == c10d::ReduceOp::PRODUCT || r == c10d::ReduceOp::MAX ||
                        r == c10d::ReduceOp::MIN || bitwise,
                    "pycomm ", op, ": ",
                    r == c10d::ReduceOp::PREMUL_SUM ? std::string("ReduceOp.PREMUL_SUM")
                                                    : c10::str("reduce op ", static_cast<int>(r)),
                    " is not supported (sum, avg, product, max, min; band, bor, bxor on "
                    "integers)");
  TORCH_CHECK_VALUE(!bitwise || at::isIntegralType(dtype, /*includeBool=*/false), "pycomm ", op,
                    ": ReduceOp.BAND/BOR/BXOR need an integer dtype, got ", dtype);
  TORCH_CHECK_VALUE(r != c10d::ReduceOp::AVG || at::isFloatingType(dtype), "pycomm ", op,
                    ": ReduceOp.AVG needs a floating dtype, got ", dtype);
}

void reduce_buffers(c10::ScalarType dtype, c10d::ReduceOp::RedOpType reduce, void* out,
                    const void* const* srcs, int nsrc, int64_t n, int world, void* copy) {
  if (n == 0) return;
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "pycomm_shm_reduce", [&] {
    reduce_typed<scalar_t>(reduce, static_cast<scalar_t*>(out), static_cast<scalar_t*>(copy), srcs,
                           nsrc, n, world);
  });
}

namespace {

template <typename T>
void scale_loop(T* dst, const T* src, int64_t n, T s) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * s;
}

// Two sources, the first (kFirst) or the second scaled: one fused loop (Note [Reduction loops]).
template <typename T, bool kFirst, bool kCopy>
void pair_scaling_one(T* out, T* copy, const T* a, const T* b, int64_t n, T s) {
  for (int64_t i = 0; i < n; ++i) {
    const T v = kFirst ? a[i] * s + b[i] : a[i] + b[i] * s;
    out[i] = v;
    if constexpr (kCopy) copy[i] = v;
  }
}

template <typename T>
void sum_scaling_loop(T* out, T* copy, const void* const* srcs, int nsrc, int64_t n, int scaled,
                      T s) {
  auto src = [&](int j) { return static_cast<const T*>(srcs[j]); };
  if (nsrc == 2) {
    if (scaled == 0) {
      copy ? pair_scaling_one<T, true, true>(out, copy, src(0), src(1), n, s)
           : pair_scaling_one<T, true, false>(out, copy, src(0), src(1), n, s);
    } else {
      copy ? pair_scaling_one<T, false, true>(out, copy, src(0), src(1), n, s)
           : pair_scaling_one<T, false, false>(out, copy, src(0), src(1), n, s);
    }
    return;
  }
  T acc[kBlock];
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t len = std::min(kBlock, n - base);
    for (int j = 0; j < nsrc; ++j) {
      const T* x = src(j) + base;
      if (j == 0) {
        for (int64_t i = 0; i < len; ++i) acc[i] = scaled == 0 ? x[i] * s : x[i];
      } else if (j == scaled) {
        for (int64_t i = 0; i < len; ++i) acc[i] += x[i] * s;
      } else {
        for (int64_t i = 0; i < len; ++i) acc[i] += x[i];
      }
    }
    T* o = out + base;
    for (int64_t i = 0; i < len; ++i) o[i] = acc[i];
    if (copy != nullptr) std::memcpy(copy + base, acc, len * sizeof(T));
  }
}

}  // namespace

void sum_scaling_one(c10::ScalarType dtype, void* out, const void* const* srcs, int nsrc, int64_t n,
                     int scaled, double scale, void* copy) {
  if (n == 0) return;
  if (dtype == at::kFloat) {
    sum_scaling_loop(static_cast<float*>(out), static_cast<float*>(copy), srcs, nsrc, n, scaled,
                     static_cast<float>(scale));
  } else {
    TORCH_CHECK(dtype == at::kDouble, "pycomm shm: sum_scaling_one of ", dtype);
    sum_scaling_loop(static_cast<double*>(out), static_cast<double*>(copy), srcs, nsrc, n, scaled,
                     scale);
  }
}

void scale_copy(c10::ScalarType dtype, void* dst, const void* src, int64_t n, double scale) {
  if (n == 0) return;
  if (scale == 1.0) {
    std::memcpy(dst, src, n * c10::elementSize(dtype));
  } else if (dtype == at::kFloat) {
    scale_loop(static_cast<float*>(dst), static_cast<const float*>(src), n,
               static_cast<float>(scale));
  } else {
    TORCH_CHECK(dtype == at::kDouble, "pycomm shm: scale_copy of ", dtype);
    scale_loop(static_cast<double*>(dst), static_cast<const double*>(src), n, scale);
  }
}

}  // namespace pycomm::shm
