// The CPU inner loops, picked once per process by CPU capability: ATen's portable at::vec
// build (cpu_default, grad_cpu.cpp) or its AVX2 + FMA build (cpu_avx2, grad_cpu_avx2.cpp),
// the same source (cpu_kernels.h) compiled twice, as ATen's own DispatchStub does.
#pragma once

#include <c10/core/ScalarType.h>

#include "grad/grad_math.h"

namespace pycomm {

struct CpuPieces {
  // Norm partial of n elements at x (See Note [Norm partials]); *nf is 0 or nan.
  void (*norm)(NormKind kind, at::ScalarType dtype, const void* x, int64_t n, double p, double* acc,
               double* nf);
  // x *= c over n elements.
  void (*scale)(at::ScalarType dtype, void* x, int64_t n, double c);
  // acc += scale * grad over n elements.
  void (*accumulate)(at::ScalarType acc_dtype, at::ScalarType grad_dtype, void* acc,
                     const void* grad, int64_t n, double scale);
  // torch's Adam step over n float32 elements (See Note [Adam in chunks, two at a time]
  // in adam_cpu.cpp), the square roots taken by root.fn.
  void (*adam_span)(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                    const AdamScalars& s, const AdamRoot& root);
  const char* name;
};

// The pieces this process uses (AVX2 where ATen reports AVX2 or better).
const CpuPieces& cpu_pieces();

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define PYCOMM_HAVE_AVX2_PIECES
namespace cpu_avx2 {
const CpuPieces& pieces();  // grad_cpu_avx2.cpp
}
#endif

}  // namespace pycomm
