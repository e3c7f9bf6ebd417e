// See wire_codec.h (Note [Low-precision wire]).
#include "shm/wire_codec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "shm/lowp_convert.h"

namespace pycomm::shm {

namespace {

inline int64_t round_up4(int64_t n) { return (n + 3) / 4 * 4; }
inline int64_t int8_blocks(int64_t n) { return (n + kInt8Block - 1) / kInt8Block; }

inline uint32_t abs_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u & 0x7fffffffu;
}

// The largest |x| of a block as bits: for non-negative floats the bit patterns order as
// the values do (infinity above every finite value, nan above infinity), and an integer
// max vectorises where a float max with nan semantics does not.
inline uint32_t max_abs_bits(const float* x, const float* r, int64_t n) {
  uint32_t m = 0;
  if (r == nullptr) {
    for (int64_t i = 0; i < n; ++i) m = std::max(m, abs_bits(x[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) m = std::max(m, abs_bits(x[i] + r[i]));
  }
  return m;
}

constexpr uint32_t kInfBits = 0x7f800000u;
// Adding and subtracting 1.5 x 2^23 rounds a float of magnitude below 2^22 to the nearest
// integer, ties to even (the current rounding mode), in two vectorisable operations.
constexpr float kRound = 12582912.0f;

PYCOMM_SHM_CLONES void encode_int8(const float* src, int64_t n, uint8_t* dst, float* residual) {
  const int64_t blocks = int8_blocks(n);
  float* scales = reinterpret_cast<float*>(dst);  // wire_bytes keeps dst 4-byte aligned
  int8_t* q = reinterpret_cast<int8_t*>(dst + 4 * blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    // b < blocks, so 1 <= len <= kInt8Block (stated for the compiler's bounds check)
    const int64_t begin = b * kInt8Block, len = std::clamp<int64_t>(n - begin, 1, kInt8Block);
    const float* x = src + begin;
    float* r = residual ? residual + begin : nullptr;
    int8_t* out = q + begin;
    const uint32_t mbits = max_abs_bits(x, r, len);
    if (mbits >= kInfBits) {  // inf or nan: the block decodes as nan, residuals unchanged
      scales[b] = std::numeric_limits<float>::quiet_NaN();
      std::fill(out, out + len, int8_t{0});
      continue;
    }
    float m;
    std::memcpy(&m, &mbits, sizeof(m));
    const float inv = 127.0f / m;
    if (!(inv <= std::numeric_limits<float>::max())) {
      // 0, or so small (below 127 / FLT_MAX, subnormals included) that no scale decodes
      // it: sent as zeros, and kept whole in the residual when there is one
      scales[b] = 0.0f;
      std::fill(out, out + len, int8_t{0});
      if (r) {
        for (int64_t i = 0; i < len; ++i) r[i] += x[i];
      }
      continue;
    }
    const float scale = m / 127.0f;
    scales[b] = scale;
    if (r == nullptr) {
      for (int64_t i = 0; i < len; ++i) {
        const float v = (x[i] * inv + kRound) - kRound;
        out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
      }
    } else {
      for (int64_t i = 0; i < len; ++i) {
        const float y = x[i] + r[i];
        const float v = std::min(127.0f, std::max(-127.0f, (y * inv + kRound) - kRound));
        out[i] = static_cast<int8_t>(v);
        r[i] = y - v * scale;  // the decoder's own product (wire_decode)
      }
    }
  }
}

PYCOMM_SHM_CLONES void decode_int8(const uint8_t* src, int64_t n, float* out, bool add) {
  const int64_t blocks = int8_blocks(n);
  const float* scales = reinterpret_cast<const float*>(src);
  const int8_t* q = reinterpret_cast<const int8_t*>(src + 4 * blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kInt8Block, len = std::min(kInt8Block, n - begin);
    const float scale = scales[b];
    const int8_t* in = q + begin;
    float* o = out + begin;
    if (scale != scale) {  // a non-finite block
      for (int64_t i = 0; i < len; ++i) o[i] = add ? o[i] + scale : scale;
      continue;
    }
    if (add) {
      for (int64_t i = 0; i < len; ++i) o[i] += static_cast<float>(in[i]) * scale;
    } else {
      for (int64_t i = 0; i < len; ++i) o[i] = static_cast<float>(in[i]) * scale;
    }
  }
}

PYCOMM_SHM_CLONES void add_bf16(const c10::BFloat16* src, int64_t n, float* out) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    float v;
    std::memcpy(&v, &u, sizeof(v));
    out[i] += v;
  }
}

}  // namespace

int64_t wire_bytes(comm::WireDtype dtype, int64_t n) {
  switch (dtype) {
    case comm::WireDtype::kFloat32: return 4 * n;
    case comm::WireDtype::kBFloat16: return round_up4(2 * n);
    case comm::WireDtype::kInt8: return 4 * int8_blocks(n) + round_up4(n);
  }
  TORCH_CHECK(false, "wire_bytes: unknown wire dtype");
}

void wire_encode(comm::WireDtype dtype, const float* src, int64_t n, uint8_t* dst,
                 float* residual) {
  switch (dtype) {
    case comm::WireDtype::kFloat32:
      TORCH_CHECK(residual == nullptr, "wire_encode: the fp32 wire keeps no residual");
      std::memcpy(dst, src, 4 * n);
      return;
    case comm::WireDtype::kBFloat16:
      TORCH_CHECK(residual == nullptr, "wire_encode: the bf16 wire keeps no residual");
      from_float(src, reinterpret_cast<c10::BFloat16*>(dst), n);
      return;
    case comm::WireDtype::kInt8: encode_int8(src, n, dst, residual); return;
  }
}

void wire_decode(comm::WireDtype dtype, const uint8_t* src, int64_t n, float* out, bool add) {
  switch (dtype) {
    case comm::WireDtype::kFloat32: {
      const float* s = reinterpret_cast<const float*>(src);
      if (add) {
        for (int64_t i = 0; i < n; ++i) out[i] += s[i];
      } else {
        std::memcpy(out, s, 4 * n);
      }
      return;
    }
    case comm::WireDtype::kBFloat16: {
      const auto* s = reinterpret_cast<const c10::BFloat16*>(src);
      return add ? add_bf16(s, n, out) : to_float(s, out, n);
    }
    case comm::WireDtype::kInt8: decode_int8(src, n, out, add); return;
  }
}

}  // namespace pycomm::shm
