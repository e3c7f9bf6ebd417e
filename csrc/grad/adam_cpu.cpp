// pycomm::adam_step_ on CPU: torch's for-loop Adam / AdamW (decoupled weight decay) over a
// list of float32 tensors, in one pass over memory per block.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sqrt.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "grad/cpu_pieces.h"
#include "grad/grad_math.h"

namespace pycomm {
namespace {

// Note [Adam in one pass, with torch's bits]
// torch's for-loop Adam (the CPU default; what pycomm.ZeroRedundancyOptimizer steps its
// pieces with) runs nine elementwise operations per tensor, each a pass over memory and a
// dispatch: on a 25M-parameter model at 2 ranks, a rank's step of its 12.6M elements took
// 58 ms in the training step where its compulsory traffic (param, grad and both moments
// read; param and moments written: 28 bytes an element) takes 27 ms at this core's 13 GB/s.
// This kernel makes the same operations per block of kBlock elements, the block staying in
// the core's cache between them:
//   param *= 1 - lr * wd                      (when wd != 0)
//   exp_avg = lerp(exp_avg, grad, 1 - beta1)  (torch's lerp: one fused multiply-add)
//   exp_avg_sq = exp_avg_sq * beta2, then += (1 - beta2) * grad * grad  (fused)
//   root = torch.sqrt(exp_avg_sq)             (torch's own kernel, on the block)
//   param += -step_size * exp_avg / (root / (1 - beta2^step)^0.5 + eps)
// Every scalar is computed in double as torch's Python computes it (its ** is libm's pow,
// as std::pow is here), then rounded to float
// where ATen's kernels round it; every tensor operation rounds as ATen's float kernel does,
// including where its compiled vector loop fuses a multiply-add. The square root is
// ATen's own call on the block: on x86 ATen takes it from MKL's vector math, which is not
// correctly rounded (std::sqrt differs in ~0.7% of elements), so no other sqrt would do.
// The result is torch's bits, element for element, on the builds checked; an ATen built
// otherwise would not fail loudly, so pycomm/zero/adam_step.py first steps a probe both
// ways and uses this kernel only where the two agree bitwise.
//
// Note [Zeros around the square root]
// MKL's square root takes a slow path for zeros (and for denormals, infinities and nans):
// 1.6M elements of fp32, 0.5 ms random, 6.6 ms all zeros, 11.4 ms half zeros. A moment
// exp_avg_sq is exactly zero wherever every gradient so far was (a ReLU unit that never
// fired, an embedding row never looked up), and there torch's own step slows alike: on
// the bench MLP, this kernel took 39 ms in the training step against 23 ms on random
// data. sqrt(+0) is +0 in every implementation, so the first pass hands the square root a
// one where exp_avg_sq is zero and the second pass puts the zero back: the same bits,
// without the slow path (24 ms in the step). exp_avg_sq is never -0 (it starts at +0 and
// adds squares); were it, torch's denominator -0 / c + eps is eps all the same.
constexpr int64_t kBlock = 1 << 15;  // elements: 5 float arrays of a block fit a 2 MiB L2

// Blocks per parallel task: work under 2M elements stays on the calling thread (See the
// grain note of grad_cpu.cpp's list ops).
constexpr int64_t kGrainBlocks = 64;

struct Block {
  size_t tensor;
  int64_t offset, size;
};

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
  const auto options = at::TensorOptions().dtype(at::kFloat);
  // Each task's own buffer for the square roots of its blocks.
  const auto run = [&](int64_t lo, int64_t hi) {
    at::Tensor root = at::empty({kBlock}, options);
    float* r = root.mutable_data_ptr<float>();
    for (int64_t b = lo; b < hi; ++b) {
      const Block& k = blocks[static_cast<size_t>(b)];
      const AdamScalars& s = scalars[k.tensor];
      float* pk = p[k.tensor] + k.offset;
      float* mk = m[k.tensor] + k.offset;
      float* vk = v[k.tensor] + k.offset;
      pieces.adam_moments(pk, g[k.tensor] + k.offset, mk, vk, r, k.size, s);
      at::Tensor in = root.narrow(0, 0, k.size);
      at::sqrt_out(in, in);  // torch's own square root
      pieces.adam_update(pk, mk, vk, r, k.size, s);
    }
  };
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), kGrainBlocks, run);
}

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CPU, m) { m.impl("adam_step_", &adam_step_cpu_); }

}  // namespace pycomm
