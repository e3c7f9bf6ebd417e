// CUDA kernels of the fused gradient ops: grid-stride loops with per-block partials and
// one small finishing kernel (deterministic, no atomics, no host sync).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include "grad/grad_math.h"

namespace pycomm {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // partials the finishing kernel folds in one block

template <typename Acc>
__device__ Acc block_sum(Acc v) {
  __shared__ Acc shared[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? shared[lane] : Acc(0);
  if (warp == 0)
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T, typename Acc>
__global__ void sum_squares_kernel(const T* __restrict__ x, int64_t n, Acc* __restrict__ partial) {
  Acc acc(0);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    acc = square_acc<T>(acc, x[i]);
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

template <typename Acc>
__global__ void sum_partials_kernel(const Acc* __restrict__ partial, int count, Acc* __restrict__ out) {
  Acc acc(0);
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

at::Tensor sum_squares_cuda(const at::Tensor& x) {
  check_flat_floating(x, "pycomm::sum_squares", "x");
  const auto acc_dtype = reduction_dtype(x);
  auto out = at::empty({}, x.options().dtype(acc_dtype));
  const int64_t n = x.numel();
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads)));
  auto partial = at::empty({blocks}, x.options().dtype(acc_dtype));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sum_squares_cuda", [&] {
    using Acc = at::opmath_type<scalar_t>;
    sum_squares_kernel<scalar_t, Acc><<<blocks, kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), n, partial.mutable_data_ptr<Acc>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sum_partials_kernel<Acc><<<1, kThreads, 0, stream>>>(
        partial.const_data_ptr<Acc>(), blocks, out.mutable_data_ptr<Acc>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
  m.impl("sum_squares", &sum_squares_cuda);
}

}  // namespace pycomm
