// Block conversions between bfloat16/float16 buffers and float32, for the reduction loops
// of the shared-memory collectives (reduce_kernels.cpp). c10's scalar conversions do not
// vectorise (float16's is a branchy software routine without F16C in the baseline ISA):
// a 2-source 8 MiB float16 reduction took 53-73 ms through them and 3.7-4.0 ms with F16C;
// bfloat16 21 ms vs 4.7-5.9 ms with plain bit operations (this machine, loaded). Both
// round to nearest even like c10, so results keep their bits (NaN payloads aside).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

// Loops built three times, for x86-64-v4 (AVX-512), v3 (AVX2) and the baseline, the loader
// picking the best the CPU runs (GCC/Clang target_clones, an ifunc): the baseline ISA
// vectorises them 4 floats wide, without the 32-to-16 and 32-to-8 bit packs, and the
// clones encode 1.6-4x as fast (benchmarks/results/wire_cpu.md, "The codec's loops"). The
// same operations in the same order (no contraction: setup.py's -ffp-contract=off), so the
// same bits on every CPU. -DPYCOMM_SHM_NO_CLONES builds the baseline alone.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(PYCOMM_SHM_NO_CLONES)
#define PYCOMM_SHM_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PYCOMM_SHM_CLONES
#endif

namespace pycomm::shm {

void to_float(const c10::BFloat16* src, float* dst, int64_t n);
void from_float(const float* src, c10::BFloat16* dst, int64_t n);
void to_float(const c10::Half* src, float* dst, int64_t n);
void from_float(const float* src, c10::Half* dst, int64_t n);

}  // namespace pycomm::shm
