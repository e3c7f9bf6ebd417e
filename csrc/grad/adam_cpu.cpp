// pycomm::adam_step_ on CPU: torch's for-loop Adam / AdamW (decoupled weight decay) over a
// list of float32 tensors, in one pass over memory per block.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sqrt.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "grad/cpu_pieces.h"
#include "grad/grad_math.h"

// MKL's vector square root, as libtorch_cpu exports it on builds that link MKL (null where
// it does not: a weak reference). Declared with a 64-bit count: an LP64 MKL reads its low
// 32 bits, an ILP64 one all 64, and every count passed here is small.
#if defined(__GNUC__) && defined(__x86_64__)
extern "C" void vmsSqrt(int64_t n, const float* a, float* r, int64_t mode) __attribute__((weak));
// MKL's C entry for its per-thread thread count (mkl_service.h maps the lower-case name,
// which libtorch_cpu exports as the Fortran entry taking a pointer, onto this one).
extern "C" int MKL_Set_Num_Threads_Local(int n) __attribute__((weak));
#define PYCOMM_MKL_SQRT_SYMBOL
#endif

namespace pycomm {
namespace {

// Note [Adam in one pass, with torch's bits]
// torch's for-loop Adam (the CPU default; what pycomm.ZeroRedundancyOptimizer steps its
// pieces with) runs nine elementwise operations per tensor, each a pass over memory and a
// dispatch: on a 25M-parameter model at 2 ranks, a rank's step of its 12.6M elements took
// 58 ms in the training step where its compulsory traffic (param, grad and both moments
// read; param and moments written: 28 bytes an element) takes 27 ms at this core's 13 GB/s.
// This kernel makes the same operations per chunk of elements, the chunk staying in the
// core's cache between them (Note [Adam in chunks, two at a time]):
//   param *= 1 - lr * wd                      (when wd != 0)
//   exp_avg = lerp(exp_avg, grad, 1 - beta1)  (torch's lerp: one fused multiply-add)
//   exp_avg_sq = exp_avg_sq * beta2, then += (1 - beta2) * grad * grad  (fused)
//   root = torch.sqrt(exp_avg_sq)             (the square root torch's kernel takes)
//   param += -step_size * exp_avg / (root / (1 - beta2^step)^0.5 + eps)
// Every scalar is computed in double as torch's Python computes it (its ** is libm's pow,
// as std::pow is here), then rounded to float
// where ATen's kernels round it; every tensor operation rounds as ATen's float kernel does,
// including where its compiled vector loop fuses a multiply-add. The square root is
// ATen's: on x86 ATen takes it from MKL's vector math, which is not correctly rounded
// (std::sqrt differs in ~0.7% of elements), so no other sqrt would do.
// The result is torch's bits, element for element, on the builds checked; an ATen built
// otherwise would not fail loudly, so pycomm/adam_step.py first steps a probe both
// ways and uses this kernel only where the two agree bitwise.
//
// Note [Zeros around the square root]
// MKL's square root takes a slow path for zeros (and for denormals, infinities and nans):
// 1.6M elements of fp32, 0.5 ms random, 6.6 ms all zeros, 11.4 ms half zeros. A moment
// exp_avg_sq is exactly zero wherever every gradient so far was (a ReLU unit that never
// fired, an embedding row never looked up), and there torch's own step slows alike: on
// the bench MLP, this kernel took 39 ms in the training step against 23 ms on random
// data. sqrt(+0) is +0 in every implementation, so the moments hand the square root a
// one where exp_avg_sq is zero and the update puts the zero back: the same bits,
// without the slow path (24 ms in the step). exp_avg_sq is never -0 (it starts at +0 and
// adds squares); were it, torch's denominator -0 / c + eps is eps all the same.
//
// Note [Adam in chunks, two at a time]
// Taking the square root as ATen's call on a block of 32 Ki elements between two passes
// over it left the step at 15 GB/s (16M elements, one thread: 31 ms; torch's fused=True,
// whose square root is not torch's for-loop's, 20.6 ms). Timed alone on this machine's
// Xeon: the moments' pass over memory 19.7 ms, the ATen square roots 3.8 ms, the update's
// pass over the block in L2 7 ms, all of it spent in two divisions per element. The
// divisions and the memory traffic ran one after the other. So the step now goes through
// chunks, and one loop both updates chunk k and makes the moments of chunk k + 1: the
// divider and the memory work at once. The moments no longer read or write param (its
// decay is applied in the update, from the same param: the same bits). Where MKL's vector
// square root is exported (the symbol ATen's own sqrt kernel calls, with ATen's mode:
// AdamRoute::kMkl), it is called directly on chunks of kChunk elements in L1, with no
// dispatch per call: 16M elements take 23 ms, 1M 0.8 ms (fused: 20.6 and 0.84). Elsewhere
// ATen's call stays, on chunks of a block (AdamRoute::kAten). The direct call is used only
// after it gave ATen's bits on a sample (mkl_root_check), and the probe of
// pycomm/adam_step.py still compares whole steps.
constexpr int64_t kBlock = 1 << 15;  // elements per parallel unit, and the ATen route's chunk
constexpr int64_t kChunk = 512;      // the MKL route's chunk: 5 x 2 KiB stay in L1
// What ATen's vml.h passes MKL: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr int64_t kVmlMode = 0x2 | 0x140000 | 0x100;

// Blocks per parallel task: work under 2M elements stays on the calling thread (See the
// grain note of grad_cpu.cpp's list ops).
constexpr int64_t kGrainBlocks = 8;

struct Block {
  size_t tensor;
  int64_t offset, size;
};

enum class AdamRoute { kMkl, kAten };

void aten_root(float* x, int64_t n, void* /*context*/) {
  at::Tensor t = at::from_blob(x, {n}, at::TensorOptions().dtype(at::kFloat));
  at::sqrt_out(t, t);  // torch's own square root
}

#ifdef PYCOMM_MKL_SQRT_SYMBOL
void mkl_root(float* x, int64_t n, void* /*context*/) { vmsSqrt(n, x, x, kVmlMode); }
#endif

// Note [MKL on the calling thread]
// Called outside a parallel region (a task of one thread, or one thread in all), MKL may
// split a call over threads of its own. That costs each call their start (1M elements at 2
// torch threads: 4.6 ms against 0.8 ms on one), and on torch 2.13's CPU wheel it changes
// the bits: in about a quarter of fresh processes at 2 threads, torch.sqrt of 4099 floats
// of which 1024 are zeros came back with the second half's square roots ~1e-4 off (a zero,
// an infinity or a nan in the input, and MKL's second thread computes the rest otherwise).
// torch's own for-loop Adam meets that where it takes sqrt of an exp_avg_sq with zeros;
// this kernel never does: the zeros are kept out (Note [Zeros around the square root]) and
// MKL is held to the calling thread while the step runs, by MKL's per-thread setting, put
// back after.
class OnThisThread {
 public:
  OnThisThread() {
#ifdef PYCOMM_MKL_SQRT_SYMBOL
    if (MKL_Set_Num_Threads_Local != nullptr) before_ = MKL_Set_Num_Threads_Local(1);
#endif
  }
  ~OnThisThread() {
#ifdef PYCOMM_MKL_SQRT_SYMBOL
    if (before_ >= 0) MKL_Set_Num_Threads_Local(before_);
#endif
  }
  OnThisThread(const OnThisThread&) = delete;
  OnThisThread& operator=(const OnThisThread&) = delete;

 private:
  int before_ = -1;
};

// Why MKL's square root cannot be called directly here ("" when it can): the symbol, and
// the same bits as ATen's sqrt on a sample of magnitudes from the smallest normal to 1e22
// (what the kernel hands it: no zeros, Note [Zeros around the square root]), in chunks of
// many remainders, MKL on this thread alone for both (Note [MKL on the calling thread]).
std::string mkl_root_check() {
#ifdef PYCOMM_MKL_SQRT_SYMBOL
  if (!at::hasMKL()) return "this torch is built without MKL";
  if (vmsSqrt == nullptr) return "this torch does not export MKL's vmsSqrt";
  constexpr int64_t n = 4 * kChunk + 37;
  at::Tensor x = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  float* data = x.mutable_data_ptr<float>();
  uint32_t bits = 12345;
  for (int64_t i = 0; i < n; ++i) {
    bits = bits * 1664525u + 1013904223u;  // a fixed sequence of exponents and mantissas
    uint32_t word = (bits >> 9) | (((bits >> 24) % 200 + 1) << 23);
    std::memcpy(data + i, &word, sizeof(word));
  }
  const OnThisThread mkl_here;
  at::Tensor theirs = at::sqrt(x);
  at::Tensor ours = x.clone();
  for (int64_t at = 0, c = 1; at < n; at += c, c = c % kChunk + 7)
    mkl_root(ours.mutable_data_ptr<float>() + at, std::min(c, n - at), nullptr);
  if (std::memcmp(theirs.const_data_ptr<float>(), ours.const_data_ptr<float>(), n * 4) != 0)
    return "MKL's vmsSqrt called directly differs from at::sqrt in this build";
  return "";
#else
  return "MKL's vmsSqrt is looked for on x86-64 only";
#endif
}

const std::string& mkl_root_refusal() {
  static const std::string why = mkl_root_check();
  return why;
}

// The route the step takes: kMkl where mkl_root_refusal() is empty, else kAten; the tests
// of both set it (adam_route).
std::atomic<int>& route_setting() {
  static std::atomic<int> route{
      static_cast<int>(mkl_root_refusal().empty() ? AdamRoute::kMkl : AdamRoute::kAten)};
  return route;
}

// The scalars of tensor i's step number `step`, hyper its row of the op's hyper.
AdamScalars adam_scalars(const double* hyper, double step, size_t i) {
  const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3],
               weight_decay = hyper[4];
  AdamScalars s;
  s.decays = weight_decay != 0.0;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.weight = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double correction1 = 1.0 - std::pow(beta1, step);
  const double correction2 = 1.0 - std::pow(beta2, step);
  // torch's Python raises ZeroDivisionError on lr / 0 (beta1 = 1); so does this, before
  // anything is written, rather than step with an infinite step size.
  TORCH_CHECK_VALUE(correction1 != 0.0, "pycomm::adam_step_: tensor ", i, "'s step ", step,
                    " has 1 - beta1^step = 0 (beta1 = ", beta1,
                    "), and the step size lr / (1 - beta1^step) divides by zero");
  s.root_correction = static_cast<float>(std::pow(correction2, 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / correction1));
  return s;
}

void check_adam_tensor(const at::Tensor& t, const at::Tensor& param, const char* arg, size_t i) {
  constexpr const char* op = "pycomm::adam_step_";
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ",
              arg, "[", i, "] must be a contiguous float32 CPU tensor, got ", t.scalar_type(),
              " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(t.numel() == param.numel(), op, ": ", arg, "[", i, "] has ", t.numel(),
              " elements but params[", i, "] has ", param.numel());
}

// hyper: float64 [n, 5], row i = (lr, beta1, beta2, eps, weight_decay) of tensor i's group.
void adam_step_cpu_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& hyper) {
  constexpr const char* op = "pycomm::adam_step_";
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  steps.size() == n,
              op, ": params, grads, exp_avgs, exp_avg_sqs and steps must be as long; got ", n, ", ",
              grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), " and ", steps.size());
  TORCH_CHECK(hyper.device().is_cpu() && hyper.scalar_type() == at::kDouble && hyper.dim() == 2 &&
                  hyper.size(0) == static_cast<int64_t>(n) && hyper.size(1) == 5 &&
                  hyper.is_contiguous(),
              op, ": hyper must be a contiguous float64 CPU tensor of shape [", n, ", 5], got ",
              hyper.scalar_type(), hyper.sizes());
  std::vector<AdamScalars> scalars(n);
  std::vector<Block> blocks;
  const double* h = hyper.const_data_ptr<double>();
  for (size_t i = 0; i < n; ++i) {
    check_adam_tensor(params[i], params[i], "params", i);
    check_adam_tensor(grads[i], params[i], "grads", i);
    check_adam_tensor(exp_avgs[i], params[i], "exp_avgs", i);
    check_adam_tensor(exp_avg_sqs[i], params[i], "exp_avg_sqs", i);
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].device().is_cpu() &&
                    (steps[i].scalar_type() == at::kFloat || steps[i].scalar_type() == at::kDouble),
                op, ": steps[", i, "] must be a one-element float32/float64 CPU tensor, got ",
                steps[i].scalar_type(), steps[i].sizes());
  }
  // torch: step_t += 1, then the scalars from step_t.item(); the counters are written
  // once every tensor's scalars are known to be finite.
  std::vector<double> next(n);
  for (size_t i = 0; i < n; ++i) {
    next[i] = steps[i].scalar_type() == at::kFloat
                  ? static_cast<double>(*steps[i].const_data_ptr<float>() + 1.0f)
                  : *steps[i].const_data_ptr<double>() + 1.0;
    scalars[i] = adam_scalars(h + 5 * i, next[i], i);
  }
  // The data pointers, taken once here rather than by every task of the parallel loop.
  std::vector<float*> p(n), m(n), v(n);
  std::vector<const float*> g(n);
  for (size_t i = 0; i < n; ++i) {
    if (steps[i].scalar_type() == at::kFloat)
      *steps[i].mutable_data_ptr<float>() = static_cast<float>(next[i]);
    else *steps[i].mutable_data_ptr<double>() = next[i];
    p[i] = params[i].mutable_data_ptr<float>();
    g[i] = grads[i].const_data_ptr<float>();
    m[i] = exp_avgs[i].mutable_data_ptr<float>();
    v[i] = exp_avg_sqs[i].mutable_data_ptr<float>();
    for (int64_t off = 0; off < params[i].numel(); off += kBlock)
      blocks.push_back({i, off, std::min(kBlock, params[i].numel() - off)});
  }
  const CpuPieces& pieces = cpu_pieces();
  AdamRoot root{&aten_root, nullptr, kBlock, nullptr};
#ifdef PYCOMM_MKL_SQRT_SYMBOL
  if (static_cast<AdamRoute>(route_setting().load()) == AdamRoute::kMkl)
    root = AdamRoot{&mkl_root, nullptr, kChunk, nullptr};
#endif
  // A task's blocks, consecutive blocks of one tensor as one span; each task its own
  // buffers for the square roots.
  const auto run = [&](int64_t lo, int64_t hi) {
    std::vector<float> buffers(2 * static_cast<size_t>(root.chunk));
    const OnThisThread mkl_here;  // either route's square roots are MKL's
    AdamRoot mine = root;
    mine.buffers = buffers.data();
    for (int64_t b = lo; b < hi;) {
      const Block& first = blocks[static_cast<size_t>(b)];
      int64_t size = 0;
      for (; b < hi && blocks[static_cast<size_t>(b)].tensor == first.tensor; ++b)
        size += blocks[static_cast<size_t>(b)].size;
      const size_t i = first.tensor;
      pieces.adam_span(p[i] + first.offset, g[i] + first.offset, m[i] + first.offset,
                       v[i] + first.offset, size, scalars[i], mine);
    }
  };
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), kGrainBlocks, run);
}

}  // namespace

// pycomm._C._adam_route(want) (clip_bind.cpp): the route now ("mkl" or "aten") after setting it to
// `want`
// ("" leaves it; "auto" is the default choice; "mkl" raises, naming why, where refused).
std::string adam_route(const std::string& want) {
  if (want == "auto") {
    route_setting() = static_cast<int>(mkl_root_refusal().empty() ? AdamRoute::kMkl
                                                                  : AdamRoute::kAten);
  } else if (want == "mkl") {
    const std::string why = mkl_root_refusal();
    TORCH_CHECK_VALUE(why.empty(),
                      "pycomm._C._adam_route: cannot take the square root through MKL: ", why);
    route_setting() = static_cast<int>(AdamRoute::kMkl);
  } else if (want == "aten") {
    route_setting() = static_cast<int>(AdamRoute::kAten);
  } else {
    TORCH_CHECK_VALUE(want.empty(),
                      "pycomm._C._adam_route: want must be \"\", \"auto\", \"mkl\" or ",
                      "\"aten\", got \"", want, "\"");
  }
  return static_cast<AdamRoute>(route_setting().load()) == AdamRoute::kMkl ? "mkl" : "aten";
}

TORCH_LIBRARY_IMPL(pycomm, CPU, m) { m.impl("adam_step_", &adam_step_cpu_); }

}  // namespace pycomm
