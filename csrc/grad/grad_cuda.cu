// CUDA kernels of the fused gradient ops: per-block partials and one small finishing
// kernel (deterministic, no atomics, no host sync); lists of tensors go through
// multi_tensor.cuh, one launch per 320 chunks or 96 tensors, with 16-byte loads.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "grad/block_reduce.cuh"
#include "grad/grad_math.h"
#include "grad/multi_tensor.cuh"
#include "grad/span_list.h"

namespace pycomm {
namespace {

constexpr int kMaxBlocks = 1024;  // partials the finishing kernel folds in one block

template <typename T, typename Acc>
__global__ void sum_squares_kernel(const T* __restrict__ x, int64_t n, Acc* __restrict__ partial) {
  Acc acc(0);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    acc = square_acc<T>(acc, x[i]);
  acc = block_reduce(acc, Plus<Acc>{});
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

template <typename Acc>
__global__ void sum_partials_kernel(const Acc* __restrict__ partial, int count,
                                    Acc* __restrict__ out) {
  Acc acc(0);
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_reduce(acc, Plus<Acc>{});
  if (threadIdx.x == 0) *out = acc;
}

at::Tensor sum_squares_cuda(const at::Tensor& x) {
  check_flat_floating(x, "pycomm::sum_squares", "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto acc_dtype = reduction_dtype(x);
  auto out = at::empty({}, x.options().dtype(acc_dtype));
  const int64_t n = x.numel();
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads)));
  auto partial = at::empty({blocks}, x.options().dtype(acc_dtype));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "sum_squares_cuda", [&] {
        using Acc = at::opmath_type<scalar_t>;
        sum_squares_kernel<scalar_t, Acc>
            <<<blocks, kThreads, 0, stream>>>(x.const_data_ptr<scalar_t>(), n,
                                              partial.mutable_data_ptr<Acc>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        sum_partials_kernel<Acc><<<1, kThreads, 0, stream>>>(partial.const_data_ptr<Acc>(), blocks,
                                                             out.mutable_data_ptr<Acc>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

// Calls visit(x, i) for every element of a block's piece, 16-byte loads where aligned.
template <typename T, typename Visit>
__device__ inline void for_each_element(const T* x, int64_t n, Visit&& visit) {
  using P = Pack<T>;
  int64_t start = 0;
  if (is_aligned_for<P>(x)) {
    const int64_t packs = n / P::kSize;
    const P* xp = reinterpret_cast<const P*>(x);
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const P v = xp[i];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) visit(v.v[k]);
    }
    start = packs * P::kSize;
  }
  for (int64_t i = start + threadIdx.x; i < n; i += blockDim.x) visit(x[i]);
}

// One norm partial per chunk (See Note [Norm partials]); nonfinite is 0 or nan here.
template <NormKind K, typename T, typename Out>
__global__ void norm_partial_kernel(ChunkTable<1> table, Out* __restrict__ partial,
                                    int64_t first_block, double p) {
  using Acc = at::opmath_type<T>;
  const BlockPiece piece = block_piece(table);
  const T* x = static_cast<const T*>(table.ptr[0][piece.slot]) + piece.offset;
  const Acc pa = static_cast<Acc>(p);
  Acc acc(0), nf(0);
  for_each_element(x, piece.n, [&](T e) {
    const Acc v = static_cast<Acc>(e);
    acc = norm_step<K, Acc>(acc, v, pa);
    nf += v - v;
  });
  acc = block_reduce(acc, Combine<K, Acc>{});
  nf = block_reduce(nf, Plus<Acc>{});
  if (threadIdx.x == 0) {
    partial[2 * (first_block + blockIdx.x)] = static_cast<Out>(acc);
    partial[2 * (first_block + blockIdx.x) + 1] = static_cast<Out>(nf);
  }
}

// Folds `count` chunk partials into out = [acc, nonfinite 0/1], in a fixed order.
template <NormKind K, typename Out>
__global__ void finish_partials_kernel(const Out* __restrict__ partial, int64_t count,
                                       Out* __restrict__ out) {
  Out acc(0), nf(0);
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    acc = norm_combine<K, Out>(acc, partial[2 * i]);
    nf += partial[2 * i + 1];
  }
  acc = block_reduce(acc, Combine<K, Out>{});
  nf = block_reduce(nf, Plus<Out>{});
  if (threadIdx.x == 0) {
    out[0] = acc;
    out[1] = nf != nf ? Out(1) : Out(0);
  }
}

// The list's spans grouped by dtype: one set of launches per dtype.
struct DtypeGroup {
  at::ScalarType dtype;
  std::vector<std::array<void*, 1>> ptrs;
  std::vector<int64_t> numels;
};

std::vector<DtypeGroup> group_by_dtype(const SpanList& l) {
  std::vector<DtypeGroup> groups;
  for (const Span& s : l.spans) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const DtypeGroup& g) { return g.dtype == s.dtype; });
    if (it == groups.end()) it = groups.insert(groups.end(), DtypeGroup{s.dtype, {}, {}});
    it->ptrs.push_back({s.data});
    it->numels.push_back(s.numel);
  }
  return groups;
}

template <NormKind K, typename Out>
void launch_norm_partial(const std::vector<DtypeGroup>& groups, double p, Out* partial, Out* out,
                         cudaStream_t stream) {
  int64_t base = 0;
  for (const DtypeGroup& g : groups) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.dtype, "norm_partial_cuda", [&] {
      launch_chunks<1>(g.ptrs, g.numels, [&](const ChunkTable<1>& t, int blocks, int64_t first) {
        norm_partial_kernel<K, scalar_t, Out>
            <<<blocks, kThreads, 0, stream>>>(t, partial, base + first, p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    base += count_chunks(g.numels);
  }
  finish_partials_kernel<K, Out><<<1, kThreads, 0, stream>>>(partial, base, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor norm_partial_cuda(at::TensorList tensors, double norm_type) {
  constexpr const char* op = "pycomm::norm_partial";
  const NormKind kind = norm_kind(norm_type, op);
  const c10::cuda::CUDAGuard guard(check_tensor_list(tensors, op, "tensors"));
  std::vector<at::Tensor> copies;
  const auto groups = group_by_dtype(read_spans(tensors, copies));
  int64_t chunks = 0;
  for (const auto& g : groups) chunks += count_chunks(g.numels);
  const auto opts = tensors[0].options().dtype(partial_dtype(tensors));
  auto partial = at::empty({2 * std::max<int64_t>(chunks, 1)}, opts);
  auto out = at::empty({2}, opts);
  auto stream = c10::cuda::getCurrentCUDAStream();
  with_norm_kind(kind, [&](auto k) {
    AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "norm_partial_cuda_out", [&] {
      launch_norm_partial<decltype(k)::value, scalar_t>(groups, norm_type,
                                                        partial.mutable_data_ptr<scalar_t>(),
                                                        out.mutable_data_ptr<scalar_t>(), stream);
    });
  });
  return out;
}

// x *= factor. The factor is read on the device first: at 1 (clipping inactive) every
// block returns before touching memory, so skipping the pass needs no host sync.
template <typename T, typename C>
__global__ void scale_kernel(ChunkTable<1> table, const C* __restrict__ factor) {
  using Acc = at::opmath_type<T>;
  const Acc c = static_cast<Acc>(*factor);
  if (c == Acc(1)) return;
  const BlockPiece piece = block_piece(table);
  T* x = static_cast<T*>(table.ptr[0][piece.slot]) + piece.offset;
  using P = Pack<T>;
  int64_t start = 0;
  if (is_aligned_for<P>(x)) {
    const int64_t packs = piece.n / P::kSize;
    P* xp = reinterpret_cast<P*>(x);
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      P v = xp[i];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) v.v[k] = static_cast<T>(static_cast<Acc>(v.v[k]) * c);
      xp[i] = v;
    }
    start = packs * P::kSize;
  }
  for (int64_t i = start + threadIdx.x; i < piece.n; i += blockDim.x)
    x[i] = static_cast<T>(static_cast<Acc>(x[i]) * c);
}

void scale_cuda_(at::TensorList tensors, const at::Tensor& factor_in) {
  constexpr const char* op = "pycomm::scale_";
  const c10::Device device = check_tensor_list(tensors, op, "tensors");
  TORCH_CHECK(factor_in.numel() == 1 && at::isFloatingType(factor_in.scalar_type()), op,
              ": factor must be a one-element floating tensor, got shape ", factor_in.sizes(),
              " and dtype ", factor_in.scalar_type());
  TORCH_CHECK(factor_in.device() == device || factor_in.device().is_cpu(), op, ": factor is on ",
              factor_in.device(), " but tensors are on ", device);
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor factor = factor_in;
  if (factor.device().is_cpu()) {  // a host value: decide here, move it without a sync
    const double c = factor.item<double>();
    if (c == 1.0) return;
    factor = at::full({}, c, tensors[0].options().dtype(at::kDouble));
  }
  std::vector<size_t> strided;
  const auto groups = group_by_dtype(write_spans(tensors, strided));
  for (size_t i : strided) tensors[i].mul_(factor);
  auto stream = c10::cuda::getCurrentCUDAStream();
  for (const DtypeGroup& g : groups) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.dtype, "scale_cuda_", [&] {
      using T = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(
          at::kHalf, at::kBFloat16, factor.scalar_type(), "scale_cuda_factor", [&] {
            const scalar_t* f = factor.const_data_ptr<scalar_t>();
            launch_chunks<1>(g.ptrs, g.numels, [&](const ChunkTable<1>& t, int blocks, int64_t) {
              scale_kernel<T, scalar_t><<<blocks, kThreads, 0, stream>>>(t, f);
              C10_CUDA_KERNEL_LAUNCH_CHECK();
            });
          });
    });
  }
}

// acc += scale * grad; TA is TG, or float32 for a half/bfloat16 TG. Loads as many grad
// elements per access as one 16-byte access of acc covers.
template <typename TA, typename TG>
__global__ void accumulate_kernel(ChunkTable<2> table, at::opmath_type<TA> scale) {
  const BlockPiece piece = block_piece(table);
  TA* a = static_cast<TA*>(table.ptr[0][piece.slot]) + piece.offset;
  const TG* g = static_cast<const TG*>(table.ptr[1][piece.slot]) + piece.offset;
  using PA = Pack<TA>;
  using PG = Pack<TG, PA::kSize>;
  int64_t start = 0;
  if (is_aligned_for<PA>(a) && is_aligned_for<PG>(g)) {
    const int64_t packs = piece.n / PA::kSize;
    PA* ap = reinterpret_cast<PA*>(a);
    const PG* gp = reinterpret_cast<const PG*>(g);
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      PA va = ap[i];
      const PG vg = gp[i];
#pragma unroll
      for (int k = 0; k < PA::kSize; ++k) va.v[k] = scaled_add<TA, TG>(va.v[k], vg.v[k], scale);
      ap[i] = va;
    }
    start = packs * PA::kSize;
  }
  for (int64_t i = start + threadIdx.x; i < piece.n; i += blockDim.x)
    a[i] = scaled_add<TA, TG>(a[i], g[i], scale);
}

template <typename TG>
void launch_accumulate(bool widen, const std::vector<std::array<void*, 2>>& ptrs,
                       const std::vector<int64_t>& numels, double scale, cudaStream_t stream) {
  if (!widen) {
    launch_chunks<2>(ptrs, numels, [&](const ChunkTable<2>& t, int blocks, int64_t) {
      accumulate_kernel<TG, TG>
          <<<blocks, kThreads, 0, stream>>>(t, static_cast<at::opmath_type<TG>>(scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else if constexpr (!std::is_same_v<TG, float> && !std::is_same_v<TG, double>) {
    launch_chunks<2>(ptrs, numels, [&](const ChunkTable<2>& t, int blocks, int64_t) {
      accumulate_kernel<float, TG><<<blocks, kThreads, 0, stream>>>(t, static_cast<float>(scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

void accumulate_cuda_(at::TensorList acc, at::TensorList grads, double scale) {
  constexpr const char* op = "pycomm::accumulate_";
  const c10::cuda::CUDAGuard guard(check_tensor_list(acc, op, "acc"));
  TORCH_CHECK(acc.size() == grads.size(), op, ": acc has ", acc.size(), " tensors but grads has ",
              grads.size());
  // (acc dtype, grad dtype) -> pairs; at most a few distinct combinations.
  std::vector<std::pair<std::pair<at::ScalarType, at::ScalarType>, size_t>> keys;
  std::vector<std::vector<std::array<void*, 2>>> ptrs;
  std::vector<std::vector<int64_t>> numels;
  for (size_t i = 0; i < acc.size(); ++i) {
    check_accumulate_pair(acc[i], grads[i], i, op);
    if (acc[i].numel() == 0) continue;
    if (!is_flat_span(acc[i]) || acc[i].strides() != grads[i].strides()) {
      acc[i].add_(grads[i], scale);  // layouts differ: torch's strided elementwise path
      continue;
    }
    const auto key = std::make_pair(acc[i].scalar_type(), grads[i].scalar_type());
    auto it = std::find_if(keys.begin(), keys.end(), [&](const auto& k) { return k.first == key; });
    if (it == keys.end()) {
      it = keys.insert(keys.end(), {key, ptrs.size()});
      ptrs.emplace_back();
      numels.emplace_back();
    }
    ptrs[it->second].push_back({acc[i].mutable_data_ptr(),
                                const_cast<void*>(grads[i].const_data_ptr())});
    numels[it->second].push_back(acc[i].numel());
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  for (const auto& [key, slot] : keys) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.second, "accumulate_cuda_", [&] {
      launch_accumulate<scalar_t>(key.first != key.second, ptrs[slot], numels[slot], scale, stream);
    });
  }
}

template <typename P, typename T>
__global__ void clip_coef_kernel(const P* __restrict__ partial, NormKind kind, double p,
                                 double max_norm, T* __restrict__ total,
                                 at::opmath_type<T>* __restrict__ coef) {
  using Acc = at::opmath_type<T>;
  const T t = static_cast<T>(norm_finish<Acc>(static_cast<Acc>(partial[0]), kind,
                                              static_cast<Acc>(p)));
  *total = t;
  *coef = clip_coefficient<T>(t, static_cast<Acc>(max_norm));
}

std::tuple<at::Tensor, at::Tensor> clip_coef_cuda(const at::Tensor& partial, double norm_type,
                                                  double max_norm, at::ScalarType norm_dtype) {
  constexpr const char* op = "pycomm::clip_coef";
  const NormKind kind = norm_kind(norm_type, op);
  check_partial(partial, norm_dtype, op);
  const c10::cuda::CUDAGuard guard(partial.device());
  auto total = at::empty({}, partial.options().dtype(norm_dtype));
  auto coef = at::empty({}, partial.options().dtype(at::toOpMathType(norm_dtype)));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "clip_coef_cuda", [&] {
    using P = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, norm_dtype, "clip_coef_cuda_norm", [&] {
          clip_coef_kernel<P, scalar_t>
              <<<1, 1, 0, stream>>>(partial.const_data_ptr<P>(), kind, norm_type, max_norm,
                                    total.mutable_data_ptr<scalar_t>(),
                                    coef.mutable_data_ptr<at::opmath_type<scalar_t>>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
  return {total, coef};
}

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
  m.impl("sum_squares", &sum_squares_cuda);
  m.impl("norm_partial", &norm_partial_cuda);
  m.impl("scale_", &scale_cuda_);
  m.impl("accumulate_", &accumulate_cuda_);
  m.impl("clip_coef", &clip_coef_cuda);
}

}  // namespace pycomm
