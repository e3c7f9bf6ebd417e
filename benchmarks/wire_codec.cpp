// How fast the low-precision wire's codec loops run (csrc/shm/wire_codec.cpp,
// lowp_convert.cpp): encode, decode and decode-and-add of 4 Mi float32 values (a bucket's
// piece), best of 15 calls each, bf16 and int8, beside a plain copy of the floats (the
// memory bound). Built twice from the same sources, with the loops' CPU clones (the
// default) and without (-DPYCOMM_SHM_NO_CLONES: the baseline x86-64 build), and run
// alternately, the two builds side by side:
//
//   T=$(python -c "import torch, os; print(os.path.dirname(torch.__file__))")
//   for v in "" -DPYCOMM_SHM_NO_CLONES; do
//     c++ -O3 -ffp-contract=off -std=c++20 $v -Icsrc -I$T/include benchmarks/wire_codec.cpp \
//       csrc/shm/wire_codec.cpp csrc/shm/lowp_convert.cpp -L$T/lib -lc10 -Wl,-rpath,$T/lib \
//       -o /tmp/wire_codec$v
//   done
//   for i in 1 2; do /tmp/wire_codec; /tmp/wire_codec-DPYCOMM_SHM_NO_CLONES; done
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "shm/wire_codec.h"

namespace {

template <class F>
double best_ms(F&& f) {
  double best = 1e30;
  for (int i = 0; i < 15; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  using pycomm::comm::WireDtype;
  namespace shm = pycomm::shm;
  const int64_t n = int64_t{4} << 20;
  std::vector<float> x(n), y(n);
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(gen) * 1e-3f;
#ifdef PYCOMM_SHM_NO_CLONES
  const char* build = "baseline";
#else
  const char* build = "clones";
#endif
  for (const auto dtype : {WireDtype::kBFloat16, WireDtype::kInt8}) {
    std::vector<uint8_t> wire(shm::wire_bytes(dtype, n));
    const double enc = best_ms([&] { shm::wire_encode(dtype, x.data(), n, wire.data(), nullptr); });
    const double dec = best_ms([&] { shm::wire_decode(dtype, wire.data(), n, y.data(), false); });
    const double add = best_ms([&] { shm::wire_decode(dtype, wire.data(), n, y.data(), true); });
    std::printf(
        "{\"build\": \"%s\", \"wire\": \"%s\", \"floats\": %lld, \"encode_ms\": %.3f, "
        "\"decode_ms\": %.3f, \"decode_add_ms\": %.3f}\n",
        build, dtype == WireDtype::kInt8 ? "int8" : "bf16", static_cast<long long>(n), enc, dec,
        add);
  }
  const double copy = best_ms([&] { std::copy(x.begin(), x.end(), y.begin()); });
  std::printf("{\"build\": \"%s\", \"copy_ms\": %.3f}\n", build, copy);
  return 0;
}
