// CPU kernels of the fused gradient ops: at::vec inner loops, at::parallel_for over
// fixed-size chunks (so the result does not depend on the thread count). Lists of tensors
// are chunked as one virtual concatenation (span_list.h): a thousand tiny gradients cost
// what one buffer of the same size costs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "grad/cpu_lists.h"
#include "grad/cpu_pieces.h"
#include "grad/grad_math.h"
#include "grad/span_list.h"

#define PYCOMM_CPU_NS cpu_default
#include "grad/cpu_kernels.h"
#undef PYCOMM_CPU_NS

namespace pycomm {
namespace {

// Elements per reduction chunk: large enough to amortize a task, small enough that two
// cores both get work on a 1 MiB gradient bucket.
constexpr int64_t kReduceChunk = 1 << 16;

// Chunks per parallel task of the list ops: work under 4M elements (16 MiB of fp32) stays
// on the calling thread. A parallel region costs a barrier, and on a shared, oversubscribed
// host a barrier waits for a descheduled worker (measured: ~20 ms stalls at load 12 on 2
// cores), while one core already streams a cache-resident 4 MiB in ~0.1 ms.
constexpr int64_t kParallelGrainChunks = 64;

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
  Acc total = at::vec::vec_reduce_all<Acc>([](const Vec& x, const Vec& y) { return x + y; },
                                           acc0 + acc1);
  for (; i < n; ++i) total = square_acc<T>(total, p[i]);
  return total;
}

at::Tensor sum_squares_cpu(const at::Tensor& x) {
  check_flat_floating(x, "pycomm::sum_squares", "x");
  auto out = at::empty({}, x.options().dtype(reduction_dtype(x)));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "sum_squares_cpu", [&] {
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

at::Tensor norm_partial_cpu(at::TensorList tensors, double norm_type) {
  constexpr const char* op = "pycomm::norm_partial";
  const NormKind kind = norm_kind(norm_type, op);
  check_tensor_list(tensors, op, "tensors");
  std::vector<at::Tensor> copies;
  const SpanList l = read_spans(tensors, copies);
  double result[2];
  norm_partial_spans(l, kind, norm_type, result);
  auto out = at::empty({2}, tensors[0].options().dtype(partial_dtype(tensors)));
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "norm_partial_cpu_out", [&] {
    out.mutable_data_ptr<scalar_t>()[0] = static_cast<scalar_t>(result[0]);
    out.mutable_data_ptr<scalar_t>()[1] = static_cast<scalar_t>(result[1]);
  });
  return out;
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
  scale_spans(l, c);
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
      lg.add(const_cast<void*>(grads[i].const_data_ptr()), grads[i].numel(), grads[i].scalar_type(),
             i);
    } else {
      acc[i].add_(grads[i], scale);  // layouts differ: torch's strided elementwise path
    }
  }
  const CpuPieces& pieces = cpu_pieces();
  const int64_t chunks = (la.total() + kReduceChunk - 1) / kReduceChunk;
  at::parallel_for(0, chunks, kParallelGrainChunks, [&](int64_t begin, int64_t end) {
    for_each_piece(la, begin * kReduceChunk, std::min(la.total(), end * kReduceChunk),
                   [&](size_t s, int64_t off, int64_t n) {
                     const Span &a = la.spans[s], &g = lg.spans[s];
                     pieces.accumulate(
                         a.dtype, g.dtype, static_cast<char*>(a.data) + off * elementSize(a.dtype),
                         static_cast<const char*>(g.data) + off * elementSize(g.dtype), n, scale);
                   });
  });
}

// clip_coef's arithmetic on an accumulated partial `acc` (already rounded to the partial's
// dtype): writes the total norm, in norm_dtype, to *total and returns it and the clip
// coefficient (a value of at::toOpMathType(norm_dtype)), both exact in a double. Every CPU
// clip reaches it through the op (See Note [One clip finish] in clip.h).
std::pair<double, double> clip_coef_of(double acc, NormKind kind, double p, double max_norm,
                                       at::ScalarType norm_dtype, void* total) {
  double norm = 0.0, coef = 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, norm_dtype, "clip_coef_of", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const auto t = static_cast<scalar_t>(norm_finish<Acc>(static_cast<Acc>(acc), kind,
                                                          static_cast<Acc>(p)));
    *static_cast<scalar_t*>(total) = t;
    norm = static_cast<double>(t);
    coef = static_cast<double>(clip_coefficient<scalar_t>(t, static_cast<Acc>(max_norm)));
  });
  return {norm, coef};
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
    const double c =
        clip_coef_of(acc, kind, norm_type, max_norm, norm_dtype, total.mutable_data_ptr()).second;
    AT_DISPATCH_FLOATING_TYPES(coef.scalar_type(), "clip_coef_cpu_coef", [&] {
      *coef.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(c);
    });
  });
  return {total, coef};
}

}  // namespace

void norm_partial_spans(const SpanList& l, NormKind kind, double p, double out[2]) {
  const CpuPieces& pieces = cpu_pieces();
  const int64_t chunks = (l.total() + kReduceChunk - 1) / kReduceChunk;
  std::vector<double> acc(static_cast<size_t>(chunks), 0.0), nf(static_cast<size_t>(chunks), 0.0);
  at::parallel_for(0, chunks, kParallelGrainChunks, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kReduceChunk;
      for_each_piece(l, lo, std::min(l.total(), lo + kReduceChunk),
                     [&](size_t s, int64_t off, int64_t n) {
                       const Span& sp = l.spans[s];
                       double a = 0.0, f = 0.0;
                       pieces.norm(kind, sp.dtype,
                                   static_cast<const char*>(sp.data) + off * elementSize(sp.dtype),
                                   n, p, &a, &f);
                       acc[c] = kind == NormKind::kInf ? max_propagate_nan(acc[c], a) : acc[c] + a;
                       nf[c] += f;
                     });
    }
  });
  double total_acc = 0.0, total_nf = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {  // chunk order: deterministic
    total_acc = kind == NormKind::kInf ? max_propagate_nan(total_acc, acc[c]) : total_acc + acc[c];
    total_nf += nf[c];
  }
  out[0] = total_acc;
  out[1] = total_nf != total_nf ? 1.0 : 0.0;
}

void scale_spans(const SpanList& l, double c) {
  const CpuPieces& pieces = cpu_pieces();
  const int64_t chunks = (l.total() + kReduceChunk - 1) / kReduceChunk;
  // Each task walks its chunks backwards. After a norm pass over the same list (the same
  // chunks and tasks), the chunks each thread read last are still in its cache (L2, and
  // up to 32 MiB of L3 here): scaling them first saves that much of a second read.
  at::parallel_for(0, chunks, kParallelGrainChunks, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = end - 1; chunk >= begin; --chunk) {
      const int64_t lo = chunk * kReduceChunk;
      for_each_piece(
          l, lo, std::min(l.total(), lo + kReduceChunk), [&](size_t s, int64_t off, int64_t n) {
            const Span& sp = l.spans[s];
            pieces.scale(sp.dtype, static_cast<char*>(sp.data) + off * elementSize(sp.dtype), n, c);
          });
    }
  });
}

const CpuPieces& cpu_pieces() {
  static const CpuPieces pieces = [] {
#ifdef PYCOMM_HAVE_AVX2_PIECES
    // ATen's own verdict on this CPU, which honours ATEN_CPU_CAPABILITY=default.
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX2" || cap == "AVX512") return cpu_avx2::pieces();
#endif
    return CpuPieces{&cpu_default::norm_piece_any, &cpu_default::scale_piece_any,
                     &cpu_default::accumulate_piece_any, &cpu_default::adam_span_piece, "default"};
  }();
  return pieces;
}

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("sum_squares", &sum_squares_cpu);
  m.impl("norm_partial", &norm_partial_cpu);
  m.impl("scale_", &scale_cpu_);
  m.impl("accumulate_", &accumulate_cpu_);
  m.impl("clip_coef", &clip_coef_cpu);
}

}  // namespace pycomm
