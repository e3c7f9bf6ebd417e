// The C++ entry points of gradient clipping: the composite behind pycomm::clip_grad_norm_
// (csrc/grad/clip.cpp) and its eager fast path from Python (csrc/grad/clip_bind.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace pycomm {

// torch.nn.utils.clip_grad_norm_ over gradient tensors (one or more devices); returns the
// total norm on grads[0]'s device in torch's dtype. grads must not be empty.
at::Tensor clip_grad_norm_impl(at::TensorList grads, double max_norm, double norm_type,
                               bool error_if_nonfinite);

// error_if_nonfinite's check, with torch's message.
void check_total_finite(bool finite, double norm_type);

}  // namespace pycomm
