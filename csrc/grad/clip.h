// The C++ entry points of gradient clipping: the one finish every clip ends with
// (csrc/grad/clip_finish.cpp), the composite behind pycomm::clip_grad_norm_
// (csrc/grad/clip.cpp) and its eager fast path from Python (csrc/grad/clip_bind.cpp).
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

// Note [One clip finish]
// Every clip ends alike, however its norm partial was merged (one call's gradients, the
// DDP's buckets, the sharded optimizer's ranks, DTensor slots, the local clip's buckets):
// the total norm in torch's dtype and the clip coefficient, from the pycomm::clip_coef op
// (whose kernels own the arithmetic: clip_coef_of on CPU, clip_coef_kernel on CUDA), then,
// under error_if_nonfinite, torch's refusal of a non-finite total in torch's words (a host
// sync, as torch's). finish_clip is that ending, and no other code writes it: the
// composite (clip.cpp) and the eager CPU clip (clip_bind.cpp) call it, the local clip
// (reducer/local_clip.cpp) for all but the refusal, which is collective there (Note
// [Non-finite local norm]), and Python's clips from partials (clip_from_partial in
// pycomm/clip.py, the DTensor clip in pycomm/fsdp/clip.py) through pycomm._C._finish_clip.
// (The CUDA tile clip of Note [Tile plans] takes the coefficient inside its scale launch,
// with the same arithmetic from grad_math.h; it never refuses: error_if_nonfinite takes the
// composite.)
struct ClipFinish {
  at::Tensor total;  // 0-dim, norm_dtype, on the partial's device
  at::Tensor coef;   // 0-dim, at::toOpMathType(norm_dtype), on the partial's device
};

// The finish of a merged norm partial (See Note [Norm partials] in grad_math.h), the total
// norm in norm_dtype (torch's: the promotion of the gradients' dtypes).
ClipFinish finish_clip(const at::Tensor& partial, double max_norm, double norm_type,
                       bool error_if_nonfinite, at::ScalarType norm_dtype);

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
