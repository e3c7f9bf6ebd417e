// Block-wide reductions of the CUDA gradient kernels, one block of kThreads threads: the
// combine operations of Note [Norm partials] and a reduce whose order is fixed by the thread
// layout alone, so that a kernel's result is the same bits on every run.
#pragma once

#include "grad/grad_math.h"

namespace pycomm {

constexpr int kThreads = 256;  // threads of every block of the gradient kernels

template <typename Acc>
struct Plus {
  __device__ Acc operator()(Acc a, Acc b) const { return a + b; }
};

template <NormKind K, typename Acc>
struct Combine {
  __device__ Acc operator()(Acc a, Acc b) const { return norm_combine<K, Acc>(a, b); }
};

// Reduces v over the block; thread 0 holds the result. Safe to call twice in a row.
template <typename Acc, typename Op>
__device__ Acc block_reduce(Acc v, Op op) {
  __shared__ Acc shared[kThreads / 32];
  __syncthreads();  // a previous call's readers are done with `shared`
  for (int offset = 16; offset > 0; offset /= 2)
    v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? shared[lane] : Acc(0);
  if (warp == 0)
    for (int offset = 16; offset > 0; offset /= 2)
      v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace pycomm
