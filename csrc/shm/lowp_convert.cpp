// See lowp_convert.h.
#include "shm/lowp_convert.h"

#include <cstring>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define PYCOMM_SHM_F16C 1
#endif

namespace pycomm::shm {

namespace {

inline const uint16_t* bits(const void* p) { return static_cast<const uint16_t*>(p); }
inline uint16_t* bits(void* p) { return static_cast<uint16_t*>(p); }

#ifdef PYCOMM_SHM_F16C
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const uint16_t* src, float* dst,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, uint16_t* dst,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

bool have_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

}  // namespace

PYCOMM_SHM_CLONES void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = bits(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}

PYCOMM_SHM_CLONES void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = bits(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    // Round to nearest even, NaN to the canonical quiet NaN: c10::BFloat16's own rule.
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    d[i] = src[i] != src[i] ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
  }
}

void to_float(const c10::Half* src, float* dst, int64_t n) {
#ifdef PYCOMM_SHM_F16C
  if (have_f16c()) return half_to_float_f16c(bits(src), dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void from_float(const float* src, c10::Half* dst, int64_t n) {
#ifdef PYCOMM_SHM_F16C
  if (have_f16c()) return float_to_half_f16c(src, bits(dst), n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

}  // namespace pycomm::shm
