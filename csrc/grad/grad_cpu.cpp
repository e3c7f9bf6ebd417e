// CPU kernels of the fused gradient ops: at::vec inner loops, at::parallel_for over
// fixed-size chunks (so the result does not depend on the thread count). Lists of tensors
// are chunked as one virtual concatenation (span_list.h): a thousand tiny gradients cost
// what one buffer of the same size costs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "grad/grad_math.h"
#include "grad/span_list.h"

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

// Two opmath vectors' worth of T at a time: float/double load two vectors, half/bfloat16
// load one and widen it, so every dtype steps by the same count within one opmath type.
template <typename T>
struct OpmathVec {
  using Acc = at::opmath_type<T>;
  using Vec = at::vec::Vectorized<Acc>;
  static constexpr int64_t kStep = 2 * Vec::size();
  static std::pair<Vec, Vec> load(const T* p) {
    if constexpr (std::is_same_v<T, Acc>) {
      return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
    } else {
      static_assert(at::vec::Vectorized<T>::size() == kStep);
      auto [a, b] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
      return {a, b};
    }
  }
  static void store(T* p, const Vec& a, const Vec& b) {
    if constexpr (std::is_same_v<T, Acc>) {
      a.store(p);
      b.store(p + Vec::size());
    } else {
      at::vec::convert_from_float<T>(a, b).store(p);
    }
  }
};

template <NormKind K, typename Vec>
Vec vec_norm_step(const Vec& acc, const Vec& x, const Vec& p) {
  if constexpr (K == NormKind::kOne) return acc + x.abs();
  else if constexpr (K == NormKind::kTwo) return at::vec::fmadd(x, x, acc);
  else if constexpr (K == NormKind::kInf) return at::vec::maximum(acc, x.abs());
  else return acc + x.abs().pow(p);
}

// The norm partial of n elements (See Note [Norm partials]); nonfinite is 0 or nan here.
template <NormKind K, typename T>
std::pair<double, double> norm_piece(const T* x, int64_t n, double p) {
  using OV = OpmathVec<T>;
  using Acc = typename OV::Acc;
  using Vec = typename OV::Vec;
  const Vec pv(static_cast<Acc>(p));
  Vec acc0(Acc(0)), acc1(Acc(0)), nf0(Acc(0)), nf1(Acc(0));
  int64_t i = 0;
  for (; i + OV::kStep <= n; i += OV::kStep) {
    auto [a, b] = OV::load(x + i);
    acc0 = vec_norm_step<K>(acc0, a, pv);
    acc1 = vec_norm_step<K>(acc1, b, pv);
    nf0 = nf0 + (a - a);
    nf1 = nf1 + (b - b);
  }
  const auto combine = [](const Vec& u, const Vec& v) {
    if constexpr (K == NormKind::kInf) return at::vec::maximum(u, v);
    else return u + v;
  };
  Acc acc = at::vec::vec_reduce_all<Acc>(combine, combine(acc0, acc1));
  Acc nf = at::vec::vec_reduce_all<Acc>([](const Vec& u, const Vec& v) { return u + v; },
                                        nf0 + nf1);
  for (; i < n; ++i) {
    const Acc v = static_cast<Acc>(x[i]);
    acc = norm_step<K, Acc>(acc, v, static_cast<Acc>(p));
    nf += v - v;
  }
  return {static_cast<double>(acc), static_cast<double>(nf)};
}

template <NormKind K>
void norm_partial_chunks(const SpanList& l, double p, double* out) {
  const int64_t chunks = (l.total() + kReduceChunk - 1) / kReduceChunk;
  std::vector<double> acc(static_cast<size_t>(chunks), 0.0), nf(static_cast<size_t>(chunks), 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kReduceChunk;
      for_each_piece(l, lo, std::min(l.total(), lo + kReduceChunk), [&](size_t s, int64_t off, int64_t n) {
        const Span& sp = l.spans[s];
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, sp.dtype, "norm_partial_cpu", [&] {
          const auto [a, f] = norm_piece<K, scalar_t>(static_cast<const scalar_t*>(sp.data) + off, n, p);
          acc[c] = norm_combine<K, double>(acc[c], a);
          nf[c] += f;
        });
      });
    }
  });
  double total_acc = 0.0, total_nf = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {  // chunk order: deterministic
    total_acc = norm_combine<K, double>(total_acc, acc[c]);
    total_nf += nf[c];
  }
  out[0] = total_acc;
  out[1] = total_nf != total_nf ? 1.0 : 0.0;
}

at::Tensor norm_partial_cpu(at::TensorList tensors, double norm_type) {
  constexpr const char* op = "pycomm::norm_partial";
  const NormKind kind = norm_kind(norm_type, op);
  check_tensor_list(tensors, op, "tensors");
  std::vector<at::Tensor> copies;
  const SpanList l = read_spans(tensors, copies);
  double result[2];
  with_norm_kind(kind, [&](auto k) { norm_partial_chunks<decltype(k)::value>(l, norm_type, result); });
  auto out = at::empty({2}, tensors[0].options().dtype(partial_dtype(tensors)));
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "norm_partial_cpu_out", [&] {
    out.mutable_data_ptr<scalar_t>()[0] = static_cast<scalar_t>(result[0]);
    out.mutable_data_ptr<scalar_t>()[1] = static_cast<scalar_t>(result[1]);
  });
  return out;
}

// x *= c over one span piece, in opmath.
template <typename T>
void scale_piece(T* x, int64_t n, at::opmath_type<T> c) {
  using OV = OpmathVec<T>;
  const typename OV::Vec cv(c);
  int64_t i = 0;
  for (; i + OV::kStep <= n; i += OV::kStep) {
    auto [a, b] = OV::load(x + i);
    OV::store(x + i, a * cv, b * cv);
  }
  for (; i < n; ++i) x[i] = static_cast<T>(static_cast<at::opmath_type<T>>(x[i]) * c);
}

void scale_cpu_(at::TensorList tensors, const at::Tensor& factor) {
  constexpr const char* op = "pycomm::scale_";
  check_tensor_list(tensors, op, "tensors");
  TORCH_CHECK(factor.numel() == 1 && at::isFloatingType(factor.scalar_type()), op,
              ": factor must be a one-element floating tensor, got shape ", factor.sizes(),
              " and dtype ", factor.scalar_type());
  TORCH_CHECK(factor.device().is_cpu(), op, ": factor is on ", factor.device(),
              " but tensors are on cpu");
  const double c = factor.item<double>();
  if (c == 1.0) return;  // clipping inactive: no pass over memory at all
  std::vector<size_t> strided;
  const SpanList l = write_spans(tensors, strided);
  for (size_t i : strided) tensors[i].mul_(factor);
  const int64_t chunks = (l.total() + kReduceChunk - 1) / kReduceChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for_each_piece(l, begin * kReduceChunk, std::min(l.total(), end * kReduceChunk),
                   [&](size_t s, int64_t off, int64_t n) {
      const Span& sp = l.spans[s];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, sp.dtype, "scale_cpu_", [&] {
        using Acc = at::opmath_type<scalar_t>;
        scale_piece<scalar_t>(static_cast<scalar_t*>(sp.data) + off, n, static_cast<Acc>(c));
      });
    });
  });
}

// acc += scale * grad over one span piece; TA is TG or float32 (then TG is half/bfloat16).
template <typename TA, typename TG>
void accumulate_piece(TA* acc, const TG* grad, int64_t n, at::opmath_type<TA> scale) {
  using OA = OpmathVec<TA>;
  using OG = OpmathVec<TG>;
  static_assert(OA::kStep == OG::kStep);
  const typename OA::Vec sv(scale);
  int64_t i = 0;
  for (; i + OA::kStep <= n; i += OA::kStep) {
    auto [a0, a1] = OA::load(acc + i);
    auto [g0, g1] = OG::load(grad + i);
    OA::store(acc + i, at::vec::fmadd(g0, sv, a0), at::vec::fmadd(g1, sv, a1));
  }
  for (; i < n; ++i) acc[i] = scaled_add<TA, TG>(acc[i], grad[i], scale);
}

template <typename TG>
void accumulate_span(const Span& a, const Span& g, int64_t off, int64_t n, double scale) {
  if (a.dtype == g.dtype) {
    accumulate_piece<TG, TG>(static_cast<TG*>(a.data) + off, static_cast<const TG*>(g.data) + off,
                             n, static_cast<at::opmath_type<TG>>(scale));
  } else if constexpr (!std::is_same_v<TG, float> && !std::is_same_v<TG, double>) {
    accumulate_piece<float, TG>(static_cast<float*>(a.data) + off,
                                static_cast<const TG*>(g.data) + off, n, static_cast<float>(scale));
  }
}

void accumulate_cpu_(at::TensorList acc, at::TensorList grads, double scale) {
  constexpr const char* op = "pycomm::accumulate_";
  check_tensor_list(acc, op, "acc");
  TORCH_CHECK(acc.size() == grads.size(), op, ": acc has ", acc.size(), " tensors but grads has ",
              grads.size());
  SpanList la, lg;
  for (size_t i = 0; i < acc.size(); ++i) {
    check_accumulate_pair(acc[i], grads[i], i, op);
    if (is_flat_span(acc[i]) && acc[i].strides() == grads[i].strides()) {
      la.add(acc[i].mutable_data_ptr(), acc[i].numel(), acc[i].scalar_type(), i);
      lg.add(const_cast<void*>(grads[i].const_data_ptr()), grads[i].numel(),
             grads[i].scalar_type(), i);
    } else {
      acc[i].add_(grads[i], scale);  // layouts differ: torch's strided elementwise path
    }
  }
  const int64_t chunks = (la.total() + kReduceChunk - 1) / kReduceChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for_each_piece(la, begin * kReduceChunk, std::min(la.total(), end * kReduceChunk),
                   [&](size_t s, int64_t off, int64_t n) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lg.spans[s].dtype, "accumulate_cpu_",
                                      [&] { accumulate_span<scalar_t>(la.spans[s], lg.spans[s], off, n, scale); });
    });
  });
}

std::tuple<at::Tensor, at::Tensor> clip_coef_cpu(const at::Tensor& partial, double norm_type,
                                                 double max_norm, at::ScalarType norm_dtype) {
  constexpr const char* op = "pycomm::clip_coef";
  const NormKind kind = norm_kind(norm_type, op);
  check_partial(partial, norm_dtype, op);
  auto total = at::empty({}, partial.options().dtype(norm_dtype));
  auto coef = at::empty({}, partial.options().dtype(at::toOpMathType(norm_dtype)));
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "clip_coef_cpu", [&] {
    const double acc = static_cast<double>(partial.const_data_ptr<scalar_t>()[0]);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, norm_dtype, "clip_coef_cpu_norm", [&] {
      using Acc = at::opmath_type<scalar_t>;
      const auto t = static_cast<scalar_t>(
          norm_finish<Acc>(static_cast<Acc>(acc), kind, static_cast<Acc>(norm_type)));
      *total.mutable_data_ptr<scalar_t>() = t;
      *coef.mutable_data_ptr<Acc>() = clip_coefficient<scalar_t>(t, static_cast<Acc>(max_norm));
    });
  });
  return {total, coef};
}

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("sum_squares", &sum_squares_cpu);
  m.impl("norm_partial", &norm_partial_cpu);
  m.impl("scale_", &scale_cpu_);
  m.impl("accumulate_", &accumulate_cpu_);
  m.impl("clip_coef", &clip_coef_cpu);
}

}  // namespace pycomm
