// The CPU inner loops of the fused gradient ops, one span piece at a time, written once
// and compiled once per CPU capability: grad_cpu.cpp includes this file with ATen's
// default at::vec (portable), grad_cpu_avx2.cpp with its AVX2 + FMA at::vec, each inside
// its own namespace PYCOMM_CPU_NS; cpu_pieces.h picks one at run time. No include guard
// on purpose: it is included exactly once per translation unit, after the at::vec headers.
#ifndef PYCOMM_CPU_NS
#error "define PYCOMM_CPU_NS (and include the at::vec headers) before including cpu_kernels.h"
#endif

#include <ATen/Dispatch.h>

#include <cmath>
#include <utility>

#include "grad/grad_math.h"

namespace pycomm {
namespace PYCOMM_CPU_NS {

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

template <NormKind K, typename Vec>
Vec vec_norm_combine(const Vec& u, const Vec& v) {
  if constexpr (K == NormKind::kInf) return at::vec::maximum(u, v);
  else return u + v;
}

// Whether any of n elements is inf or nan: the sum of x - x is nan exactly then.
template <typename T>
double nonfinite_scan(const T* x, int64_t n) {
  using Acc = at::opmath_type<T>;
  Acc nf(0);
  for (int64_t i = 0; i < n; ++i) nf += static_cast<Acc>(x[i]) - static_cast<Acc>(x[i]);
  return static_cast<double>(nf);
}

// The norm partial of n elements (See Note [Norm partials]); nonfinite is 0 or nan here.
// Four independent accumulators (two loads of two vectors each per step), so the FMA
// latency chain does not bound a core below memory bandwidth. The hot loop tracks no
// nonfinite flag: an inf or nan element makes |x|^p, hence acc, inf or nan, so a finite
// acc proves every element finite, and only a non-finite acc pays a second scan.
template <NormKind K, typename T>
std::pair<double, double> norm_piece(const T* x, int64_t n, double p) {
  using OV = OpmathVec<T>;
  using Acc = typename OV::Acc;
  using Vec = typename OV::Vec;
  const Vec pv(static_cast<Acc>(p));
  Vec acc0(Acc(0)), acc1(Acc(0)), acc2(Acc(0)), acc3(Acc(0));
  int64_t i = 0;
  for (; i + 2 * OV::kStep <= n; i += 2 * OV::kStep) {
    auto [a, b] = OV::load(x + i);
    auto [c, d] = OV::load(x + i + OV::kStep);
    acc0 = vec_norm_step<K>(acc0, a, pv);
    acc1 = vec_norm_step<K>(acc1, b, pv);
    acc2 = vec_norm_step<K>(acc2, c, pv);
    acc3 = vec_norm_step<K>(acc3, d, pv);
  }
  for (; i + OV::kStep <= n; i += OV::kStep) {
    auto [a, b] = OV::load(x + i);
    acc0 = vec_norm_step<K>(acc0, a, pv);
    acc1 = vec_norm_step<K>(acc1, b, pv);
  }
  const auto combine = [](const Vec& u, const Vec& v) { return vec_norm_combine<K>(u, v); };
  Acc acc = at::vec::vec_reduce_all<Acc>(combine,
                                         vec_norm_combine<K>(vec_norm_combine<K>(acc0, acc1),
                                                             vec_norm_combine<K>(acc2, acc3)));
  for (; i < n; ++i) acc = norm_step<K, Acc>(acc, static_cast<Acc>(x[i]), static_cast<Acc>(p));
  const double nf = std::isfinite(static_cast<double>(acc)) ? 0.0 : nonfinite_scan(x, n);
  return {static_cast<double>(acc), nf};
}

// x *= c over one span piece, in opmath.
template <typename T>
void scale_piece(T* x, int64_t n, at::opmath_type<T> c) {
  using OV = OpmathVec<T>;
  const typename OV::Vec cv(c);
  int64_t i = 0;
  for (; i + 2 * OV::kStep <= n; i += 2 * OV::kStep) {
    auto [a, b] = OV::load(x + i);
    auto [d, e] = OV::load(x + i + OV::kStep);
    OV::store(x + i, a * cv, b * cv);
    OV::store(x + i + OV::kStep, d * cv, e * cv);
  }
  for (; i + OV::kStep <= n; i += OV::kStep) {
    auto [a, b] = OV::load(x + i);
    OV::store(x + i, a * cv, b * cv);
  }
  for (; i < n; ++i) x[i] = static_cast<T>(static_cast<at::opmath_type<T>>(x[i]) * c);
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

// Adam over n float32 elements (See Note [Adam in one pass, with torch's bits] and Note
// [Adam in chunks, two at a time] in adam_cpu.cpp), chunk after chunk of root.chunk
// elements. A chunk's moments write the square root's input into one of root.buffers
// (zeros as ones: Note [Zeros around the square root]); root.fn takes the square roots in
// place; the update reads them in the next round, so one loop both updates chunk k and
// makes the moments of chunk k + 1: the divisions of the one and the memory traffic of
// the other overlap. Each operation rounds as torch's kernel rounds it (at::vec::fmadd
// fuses where ATen's build fuses); a remainder runs the same vector code on a partial
// load, so an element's bits depend neither on its position nor on the chunk size.
inline void adam_span_piece(float* p, const float* g, float* m, float* v, int64_t n,
                            const AdamScalars& s, const AdamRoot& root) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kV = Vec::size();
  const Vec decay(s.decay), weight(s.weight), beta2(s.beta2), c2(s.one_minus_beta2);
  const Vec correction(s.root_correction), eps(s.eps), step(s.neg_step_size);
  const Vec zero(0.0f), one(1.0f);
  // torch's lerp: start + weight * (end - start) for |weight| < 0.5, else
  // end + (weight - 1) * (end - start).
  const bool small = std::abs(s.weight) < 0.5f;
  const Vec coeff = small ? weight : weight - one;
  // exp_avg.lerp_(grad), exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2); param
  // is not read here: its decay is a function of param alone, applied in update.
  const auto moments = [&](int64_t i, int64_t count, float* r) {
    const Vec gv = Vec::loadu(g + i, count);
    const Vec mv = Vec::loadu(m + i, count);
    at::vec::fmadd(coeff, gv - mv, small ? mv : gv).store(m + i, count);
    const Vec vv = at::vec::fmadd(c2 * gv, gv, Vec::loadu(v + i, count) * beta2);
    vv.store(v + i, count);
    Vec::blendv(vv, one, vv == zero).store(r, count);
  };
  // param *= decay; denom = sqrt(exp_avg_sq) / root_correction + eps; param +=
  // neg_step_size * exp_avg / denom.
  const auto update = [&](int64_t i, int64_t count, const float* r) {
    const Vec root_v = Vec::blendv(Vec::loadu(r, count), zero, Vec::loadu(v + i, count) == zero);
    const Vec denom = root_v / correction + eps;
    Vec pv = Vec::loadu(p + i, count);
    if (s.decays) pv = pv * decay;
    (pv + step * Vec::loadu(m + i, count) / denom).store(p + i, count);
  };
  const auto each = [](auto&& f, int64_t at, int64_t count, float* r) {
    int64_t j = 0;
    for (; j + kV <= count; j += kV) f(at + j, kV, r + j);
    if (j < count) f(at + j, count - j, r + j);
  };
  float* roots[2] = {root.buffers, root.buffers + root.chunk};
  int64_t last = 0, last_n = 0;  // the chunk whose roots wait for its update
  for (int64_t at = 0, k = 0; at < n; at += root.chunk, ++k) {
    const int64_t count = std::min(root.chunk, n - at);
    float* r = roots[k & 1];
    float* last_r = roots[(k + 1) & 1];
    const int64_t both = std::min(count, last_n) / kV * kV;
    for (int64_t j = 0; j < both; j += kV) {
      moments(at + j, kV, r + j);
      update(last + j, kV, last_r + j);
    }
    each(moments, at + both, count - both, r + both);
    each(update, last + both, last_n - both, last_r + both);
    root.fn(r, count, root.context);
    last = at;
    last_n = count;
  }
  each(update, last, last_n, roots[((n + root.chunk - 1) / root.chunk + 1) & 1]);
}

// Type-erased entry points: what cpu_pieces.h's table points at.
inline void norm_piece_any(NormKind kind, at::ScalarType dtype, const void* x, int64_t n, double p,
                           double* acc, double* nf) {
  with_norm_kind(kind, [&](auto k) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "norm_piece", [&] {
      const auto [a, f] = norm_piece<decltype(k)::value, scalar_t>(static_cast<const scalar_t*>(x),
                                                                   n, p);
      *acc = a;
      *nf = f;
    });
  });
}

inline void scale_piece_any(at::ScalarType dtype, void* x, int64_t n, double c) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "scale_piece", [&] {
    scale_piece<scalar_t>(static_cast<scalar_t*>(x), n, static_cast<at::opmath_type<scalar_t>>(c));
  });
}

// acc_dtype is grad_dtype, or float32 for a half/bfloat16 grad (check_accumulate_pair).
inline void accumulate_piece_any(at::ScalarType acc_dtype, at::ScalarType grad_dtype, void* acc,
                                 const void* grad, int64_t n, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_dtype, "accumulate_piece", [&] {
    using TG = scalar_t;
    if (acc_dtype == grad_dtype) {
      accumulate_piece<TG, TG>(static_cast<TG*>(acc), static_cast<const TG*>(grad), n,
                               static_cast<at::opmath_type<TG>>(scale));
    } else if constexpr (!std::is_same_v<TG, float> && !std::is_same_v<TG, double>) {
      accumulate_piece<float, TG>(static_cast<float*>(acc), static_cast<const TG*>(grad), n,
                                  static_cast<float>(scale));
    }
  });
}

}  // namespace PYCOMM_CPU_NS
}  // namespace pycomm
