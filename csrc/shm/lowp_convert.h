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

namespace pycomm::shm {

void to_float(const c10::BFloat16* src, float* dst, int64_t n);
void from_float(const float* src, c10::BFloat16* dst, int64_t n);
void to_float(const c10::Half* src, float* dst, int64_t n);
void from_float(const float* src, c10::Half* dst, int64_t n);

}  // namespace pycomm::shm
