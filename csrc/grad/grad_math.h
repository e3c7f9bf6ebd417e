// The per-element math and the argument checks of the fused gradient kernels, written
// once and included by both the CPU and the CUDA backend. No loops, no launches here.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <type_traits>

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

// Note [Norm partials]
// A norm partial is the pair (acc, nonfinite) over some elements: acc is sum |x|^p for a
// finite p, or max |x| for p = inf; nonfinite is 1 when an element is inf or nan (computed
// as the sum of x - x, which is nan exactly then), else 0. Partials of disjoint pieces
// (chunks, tensors, buckets, ranks) merge with the same operation (+ for finite p, max for
// inf, propagating nan like torch), so every level of the reduction is one combine and the
// norm is finished once: acc^(1/p). Comparing against torch, the total is
// (sum_i ||g_i||_p^p)^(1/p), the p-norm of the per-tensor norms that torch stacks.
enum class NormKind : int { kOne = 0, kTwo = 1, kInf = 2, kP = 3 };

inline NormKind norm_kind(double p, const char* op) {
  TORCH_CHECK(p > 0 && !std::isnan(p), op, ": norm_type must be > 0 or inf, got ", p,
              " (pycomm implements the p-norms torch users clip with: p > 0 and inf)");
  if (std::isinf(p)) return NormKind::kInf;
  if (p == 1.0) return NormKind::kOne;
  if (p == 2.0) return NormKind::kTwo;
  return NormKind::kP;
}

// Calls f(std::integral_constant<NormKind, K>{}) for the runtime kind: kernels are
// templates on K so the per-element branch is resolved at compile time.
template <typename F>
inline void with_norm_kind(NormKind k, F&& f) {
  switch (k) {
    case NormKind::kOne: f(std::integral_constant<NormKind, NormKind::kOne>{}); break;
    case NormKind::kTwo: f(std::integral_constant<NormKind, NormKind::kTwo>{}); break;
    case NormKind::kInf: f(std::integral_constant<NormKind, NormKind::kInf>{}); break;
    case NormKind::kP: f(std::integral_constant<NormKind, NormKind::kP>{}); break;
  }
}

template <typename Acc>
C10_HOST_DEVICE inline Acc max_propagate_nan(Acc a, Acc b) {
  return (a != a || a > b) ? a : b;  // a != a: a is nan
}

// One element folded into a partial's acc. `p` is used by kP only.
template <NormKind K, typename Acc>
C10_HOST_DEVICE inline Acc norm_step(Acc acc, Acc x, Acc p) {
  const Acc a = x < Acc(0) ? -x : x;
  if constexpr (K == NormKind::kOne) return acc + a;
  else if constexpr (K == NormKind::kTwo) return acc + x * x;
  else if constexpr (K == NormKind::kInf) return max_propagate_nan(acc, a);  // |nan| is nan
  else return acc + static_cast<Acc>(std::pow(a, p));
}

template <NormKind K, typename Acc>
C10_HOST_DEVICE inline Acc norm_combine(Acc a, Acc b) {
  if constexpr (K == NormKind::kInf) return max_propagate_nan(a, b);
  else return a + b;
}

template <typename Acc>
C10_HOST_DEVICE inline Acc norm_finish(Acc acc, NormKind k, Acc p) {
  switch (k) {
    case NormKind::kOne:
    case NormKind::kInf: return acc;
    case NormKind::kTwo: return std::sqrt(acc);
    default: return static_cast<Acc>(std::pow(acc, Acc(1) / p));
  }
}

// torch's clip coefficient min(max_norm / (total + 1e-6), 1), rounded through the norm's
// dtype T after every operation exactly as torch's tensor arithmetic does it
// (`max_norm / t` is `t.reciprocal() * max_norm` in torch), so that a half-precision norm
// gives torch's half-precision coefficient. nan stays nan, as in torch.clamp.
template <typename T, typename Acc = at::opmath_type<T>>
C10_HOST_DEVICE inline Acc clip_coefficient(T total, Acc max_norm) {
  const T denom = static_cast<T>(static_cast<Acc>(total) + static_cast<Acc>(1e-6));
  const T inv = static_cast<T>(Acc(1) / static_cast<Acc>(denom));
  const Acc coef = static_cast<Acc>(static_cast<T>(static_cast<Acc>(inv) * max_norm));
  return coef > Acc(1) ? Acc(1) : coef;
}

// acc += scale * grad, in opmath, stored back in acc's dtype.
template <typename TA, typename TG, typename Acc = at::opmath_type<TA>>
C10_HOST_DEVICE inline TA scaled_add(TA acc, TG grad, Acc scale) {
  return static_cast<TA>(static_cast<Acc>(acc) + scale * static_cast<Acc>(grad));
}

// One tensor's Adam step scalars, each rounded to float where torch's for-loop Adam rounds
// it (See Note [Adam in one pass, with torch's bits] in adam_cpu.cpp).
struct AdamScalars {
  bool decays;            // weight_decay != 0: param *= decay first (decoupled, as AdamW)
  float decay;            // 1 - lr * weight_decay
  float weight;           // 1 - beta1: exp_avg.lerp_(grad, weight)
  float beta2;            // exp_avg_sq *= beta2
  float one_minus_beta2;  // exp_avg_sq += one_minus_beta2 * grad * grad
  float root_correction;  // (1 - beta2^step)^0.5: denom = sqrt(exp_avg_sq) / it + eps
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step): param += neg_step_size * exp_avg / denom
};

// Where Adam's square roots are taken (See Note [Adam in chunks, two at a time] in
// adam_cpu.cpp): fn(x, count, context) replaces x[0..count) by their square roots, the
// step going through chunks of `chunk` elements, with buffers holding 2 * chunk floats.
struct AdamRoot {
  void (*fn)(float* x, int64_t count, void* context);
  void* context;
  int64_t chunk;
  float* buffers;
};

// Elements a kernel may treat as one flat span: dense, non-overlapping (any stride order,
// so channels-last and transposed gradients qualify; their memory is exactly numel slots
// starting at data_ptr).
inline bool is_flat_span(const at::Tensor& t) { return t.is_non_overlapping_and_dense(); }

// The checks every list op makes: non-empty, floating, one device. Returns that device.
inline c10::Device check_tensor_list(at::TensorList ts, const char* op, const char* arg) {
  TORCH_CHECK(!ts.empty(), op, ": ", arg, " must hold at least one tensor");
  const c10::Device device = ts[0].device();
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK(at::isFloatingType(ts[i].scalar_type()), op, ": ", arg, "[", i,
                "] must be a floating-point tensor, got ", ts[i].scalar_type());
    TORCH_CHECK(ts[i].device() == device, op, ": ", arg, "[", i, "] is on ", ts[i].device(),
                " but ", arg, "[0] is on ", device, "; one call covers one device");
  }
  return device;
}

// float64 when any input is float64, else float32: the dtype of a list's norm partial.
inline at::ScalarType partial_dtype(at::TensorList ts) {
  for (const auto& t : ts)
    if (t.scalar_type() == at::kDouble) return at::kDouble;
  return at::kFloat;
}

// A norm partial as norm_partial returns it: [acc, nonfinite] in float32 or float64.
inline void check_partial(const at::Tensor& partial, at::ScalarType norm_dtype, const char* op) {
  TORCH_CHECK(partial.dim() == 1 && partial.numel() == 2 && partial.is_contiguous() &&
                  (partial.scalar_type() == at::kFloat || partial.scalar_type() == at::kDouble),
              op,
              ": partial must be a contiguous float32/float64 tensor of shape [2] "
              "(as norm_partial returns it), got ",
              partial.scalar_type(), partial.sizes());
  TORCH_CHECK(at::isFloatingType(norm_dtype), op, ": norm_dtype must be floating, got ",
              norm_dtype);
}

// The pairs accumulate_ accepts: acc in grad's own dtype, or float32 for a half/bfloat16 grad.
inline void check_accumulate_pair(const at::Tensor& acc, const at::Tensor& grad, size_t i,
                                  const char* op) {
  TORCH_CHECK(acc.numel() == grad.numel(), op, ": acc[", i, "] has ", acc.numel(),
              " elements but grads[", i, "] has ", grad.numel());
  TORCH_CHECK(acc.device() == grad.device(), op, ": acc[", i, "] is on ", acc.device(),
              " but grads[", i, "] is on ", grad.device());
  const bool same = acc.scalar_type() == grad.scalar_type();
  const bool widen = acc.scalar_type() == at::kFloat &&
                     (grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16);
  TORCH_CHECK(same || widen, op, ": acc[", i, "] is ", acc.scalar_type(), " and grads[", i, "] is ",
              grad.scalar_type(),
              "; acc must have grad's dtype, or float32 for a "
              "float16/bfloat16 grad");
}

}  // namespace pycomm
