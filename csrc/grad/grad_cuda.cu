// CUDA kernels of the fused gradient ops but clipping's passes (clip_cuda.cu): per-block
// partials and one small finishing kernel (deterministic, no atomics, no host sync); lists
// of tensors go through multi_tensor.cuh, one launch per 320 chunks or 96 tensors, with
// 16-byte loads.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "grad/block_reduce.cuh"
#include "grad/grad_math.h"
#include "grad/multi_tensor.cuh"

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
  m.impl("accumulate_", &accumulate_cuda_);
  m.impl("clip_coef", &clip_coef_cuda);
}

}  // namespace pycomm
