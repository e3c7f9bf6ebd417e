// Every pycomm operator schema, one per line. Kernels register per backend in
// csrc/grad/grad_cpu.cpp and csrc/grad/grad_cuda.cu (composites in csrc/grad/clip.cpp);
// nothing else defines schemas.
#include <torch/library.h>

TORCH_LIBRARY(pycomm, m) {
  m.def("sum_squares(Tensor x) -> Tensor");
  // Fused clipping and accumulation (csrc/grad): See Note [Norm partials] in grad_math.h.
  m.def("norm_partial(Tensor[] tensors, float norm_type) -> Tensor");
  m.def("clip_coef(Tensor partial, float norm_type, float max_norm, ScalarType norm_dtype) -> "
        "(Tensor, Tensor)");
  m.def("scale_(Tensor(a!)[] tensors, Tensor factor) -> ()");
  m.def("accumulate_(Tensor(a!)[] acc, Tensor[] grads, float scale) -> ()");
  // Adam / AdamW over CPU tensors in one pass: See Note [Adam in one pass, with torch's bits].
  m.def("adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] "
        "exp_avg_sqs, Tensor(d!)[] steps, Tensor hyper) -> ()");
  m.def("clip_grad_norm_(Tensor(a!)[] grads, float max_norm, float norm_type=2., bool "
        "error_if_nonfinite=False) -> Tensor");
}
