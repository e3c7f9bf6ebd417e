// The C++ entry points of gradient clipping: the composite behind pycomm::clip_grad_norm_
// (csrc/grad/clip.cpp), its eager fast path from Python (csrc/grad/clip_bind.cpp), and
// torch's words for a non-finite norm (csrc/grad/clip_finish.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>

#include "grad/span_list.h"

namespace pycomm {

// torch.nn.utils.clip_grad_norm_ over gradient tensors (one or more devices); returns the
// total norm on grads[0]'s device in torch's dtype. grads must not be empty.
at::Tensor clip_grad_norm_impl(at::TensorList grads, double max_norm, double norm_type,
                               bool error_if_nonfinite);

// error_if_nonfinite's check, with torch's message.
void check_total_finite(bool finite, double norm_type);

// torch.nn.utils.clip_grad_norm_'s words for a non-finite total norm under
// error_if_nonfinite, character for character (norm_type written as Python writes a float).
std::string nonfinite_norm_message(double norm_type);

// What a build with CUDA adds to clipping (csrc/grad/clip_cuda.cu registers it when the
// extension loads; a build without CUDA leaves cuda_clip() null).
struct CudaClip {
  // The clip of dense gradients on one CUDA device, given as spans, in two launches and no
  // host sync (Note [Tile plans]); returns the total norm in `norm_dtype` on that device.
  at::Tensor (*clip)(const SpanList& spans, c10::Device device, double max_norm, double norm_type,
                     at::ScalarType norm_dtype);
  std::pair<int64_t, int64_t> (*plan_counts)();  // (tile plans cached, of them pinned)
  void (*clear_plans)();                         // drops the unpinned tile plans
};
const CudaClip*& cuda_clip();

}  // namespace pycomm
