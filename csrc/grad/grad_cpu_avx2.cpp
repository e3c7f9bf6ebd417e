// cpu_kernels.h compiled for AVX2 + FMA (+ F16C for half): ATen's AVX2 at::vec in its own
// inline namespace (at::vec::AVX2), so nothing here collides with the default build. Only
// run where ATen reports AVX2 (see cpu_pieces() in grad_cpu.cpp). Everything that is not
// at::vec is included before the target switch, so shared inline code is compiled for the
// baseline ISA as in every other file.
#include "grad/cpu_pieces.h"

#ifdef PYCOMM_HAVE_AVX2_PIECES

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// The target pragma enables the instructions but (in C++) not the feature macros that
// sleef.h and the at::vec headers test: state them for the headers below.
#ifndef __AVX2__
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define PYCOMM_DEFINED_AVX_MACROS
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#define PYCOMM_CPU_NS cpu_avx2
#include "grad/cpu_kernels.h"

namespace pycomm::cpu_avx2 {

const CpuPieces& pieces() {
  static const CpuPieces p{&norm_piece_any, &scale_piece_any, &accumulate_piece_any,
                           &adam_span_piece, "avx2"};
  return p;
}

}  // namespace pycomm::cpu_avx2

#pragma GCC pop_options

#endif  // PYCOMM_HAVE_AVX2_PIECES
