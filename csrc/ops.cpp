// Every pycomm operator schema, one per line. Kernels register per backend in
// csrc/grad/grad_cpu.cpp and csrc/grad/grad_cuda.cu; nothing else defines schemas.
#include <torch/library.h>

TORCH_LIBRARY(pycomm, m) {
  m.def("sum_squares(Tensor x) -> Tensor");
}
