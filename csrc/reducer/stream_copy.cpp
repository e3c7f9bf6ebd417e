#include "reducer/stream_copy.h"

#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#define PYCOMM_STREAM_COPY 1
#endif

namespace pycomm::reducer {

// Note [Streaming copies]
// torch's DDP semantics cost every gradient two copies per synchronized step: into its
// bucket slot, scaled by 1/world (copy_into_bucket), and back into param.grad once the
// bucket is reduced (finalize_bucket). For the benchmark MLP that is 100.7 MB each way,
// and perf put them at 17% of a rank's CPU in a step (2 local ranks, 32 samples), as much
// as the all-reduce itself. Neither destination is read again soon: a bucket slot waits
// for the rest of its bucket and then its collective, param.grad waits for the optimizer,
// and a destination past the core's L2 has left it by then. An ordinary store first reads
// the line it writes (read-for-ownership) and leaves it in cache, evicting what backward
// needs; a non-temporal store does neither. Measured on the 2-core VM, one thread, six
// 16 MiB gradients: the scaled copy-in 11.1-11.8 ms with at::mul_out against 6.1-6.5 ms
// streamed, the copy-out 10.8-11.3 against 6.2-6.5 ms; a 25 MiB bucket filled by 256 KiB
// to 16 MiB tensors and then read whole (the reduction) 13-24% faster streamed. Below
// kStreamCopyMinBytes ATen copies: a small slot may still be in L2 when read.
// The arithmetic is ATen's: a float32 tensor times a double scalar multiplies by the
// scalar rounded to float, one IEEE multiply per element, so results are bitwise equal
// (tests/ddp/test_stream_copy.py checks 1/3 and 1/7 at unaligned offsets and several threads).
//
// Over the shared-memory group a bucket is reduced in place instead, with neither copy
// (See Note [Gradients reduced in place]); these copies serve the buckets that are not.

#ifdef PYCOMM_STREAM_COPY
namespace {

constexpr int64_t kGrain = 32768;  // elements per task: ATen's own copies' grain

// dst[0, n) = src[0, n) * s (or copied when !scaled), dst 16-byte aligned inside.
void stream_range(float* dst, const float* src, int64_t n, bool scaled, float s) {
  int64_t i = 0;
  auto one = [&](int64_t k) { dst[k] = scaled ? src[k] * s : src[k]; };
  while (i < n && (reinterpret_cast<std::uintptr_t>(dst + i) & 15) != 0) one(i++);
  const __m128 v = _mm_set1_ps(s);
  if (scaled) {
    for (; i + 16 <= n; i += 16) {
      _mm_stream_ps(dst + i, _mm_mul_ps(_mm_loadu_ps(src + i), v));
      _mm_stream_ps(dst + i + 4, _mm_mul_ps(_mm_loadu_ps(src + i + 4), v));
      _mm_stream_ps(dst + i + 8, _mm_mul_ps(_mm_loadu_ps(src + i + 8), v));
      _mm_stream_ps(dst + i + 12, _mm_mul_ps(_mm_loadu_ps(src + i + 12), v));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
      _mm_stream_ps(dst + i + 4, _mm_loadu_ps(src + i + 4));
      _mm_stream_ps(dst + i + 8, _mm_loadu_ps(src + i + 8));
      _mm_stream_ps(dst + i + 12, _mm_loadu_ps(src + i + 12));
    }
  }
  for (; i < n; ++i) one(i);
  _mm_sfence();  // order the streamed lines before whatever this thread publishes next
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

}  // namespace
#endif

bool stream_copy(const at::Tensor& dst, const at::Tensor& src, std::optional<double> scale) {
#ifdef PYCOMM_STREAM_COPY
  if (!dst.device().is_cpu() || !src.device().is_cpu() || dst.scalar_type() != at::kFloat ||
      src.scalar_type() != at::kFloat || dst.numel() != src.numel() || !dst.is_contiguous() ||
      !src.is_contiguous() || dst.is_sparse() || src.is_sparse() || dst.is_neg() || src.is_neg() ||
      dst.is_conj() || src.is_conj() || static_cast<int64_t>(dst.nbytes()) < kStreamCopyMinBytes ||
      overlap(dst, src)) {
    return false;
  }
  float* out = dst.mutable_data_ptr<float>();
  const float* in = src.const_data_ptr<float>();
  const bool scaled = scale.has_value();
  const float s = scaled ? static_cast<float>(*scale) : 1.0f;
  at::parallel_for(0, dst.numel(), kGrain, [&](int64_t begin, int64_t end) {
    stream_range(out + begin, in + begin, end - begin, scaled, s);
  });
  return true;
#else
  (void)dst;
  (void)src;
  (void)scale;
  return false;
#endif
}

}  // namespace pycomm::reducer
