// fp32 gradient accumulation for low-precision parameters (grad_reduce_dtype; see
// main_grad.h): each gradient is added into its parameter's wide bucket view
// (param.main_grad) the moment autograd hands it over, inside no_sync or not, and the
// low-precision param.grad is freed.
//
// Note [main_grad accumulation]
// With grad_reduce_dtype, a bf16/fp16 parameter's bucket view is its fp32 main gradient. The
// grad-ready hook moves every gradient into it: the first since the last reduction is
// copied (widened), later ones are added with the fused accumulate kernel (acc += grad in
// fp32), and param.grad is set to None, so autograd starts the next micro-step from
// nothing and low-precision rounding never enters the sum. `accumulated_[i]` says the
// view holds such a local sum. The synchronized backward adds its own gradient the same
// way; copy_into_bucket then only scales the sum by 1/world (MainGrads::take) and the
// bucket is reduced in fp32. finalize_bucket hands back param.grad = the reduced sum in
// the parameter's dtype, or (main_grad_only) leaves param.grad None: the fp32 view is
// then the only result, for an fp32-master optimizer. A bucket rebuild carries pending
// sums over (MainGrads::save, restore). The sum restarts after each synchronized backward, as
// torch's does after zero_grad; a param.grad the user left defined is picked up first.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "reducer/main_grad.h"

namespace pycomm::reducer {

namespace {

void add_into(const at::Tensor& acc, const at::Tensor& grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::accumulate_", "")
                       .typed<void(at::TensorList, at::TensorList, double)>();
  // Not differentiable, and called once per gradient during backward: skip the boxed
  // Autograd/ADInplaceOrView fallbacks (see clip_grad_norm_impl in csrc/grad/clip.cpp).
  c10::impl::ExcludeDispatchKeyGuard below_autograd(
      c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  op.call({acc}, {grad}, 1.0);
}

}  // namespace

void MainGrads::reset(const BucketLayout& layout, const std::vector<at::Tensor>& params) {
  widened_.assign(params.size(), 0);
  accumulated_.assign(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    widened_[i] = layout.view(i).scalar_type() != params[i].scalar_type();
  }
}

void MainGrads::accumulate(size_t index, const at::Tensor& param, const at::Tensor& view,
                           const std::string& name) {
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) return;
  TORCH_CHECK_VALUE(!grad.is_sparse(), "parameter ", name,
                    " has a sparse gradient: "
                    "pycomm DDP reduces dense gradients only (use sparse=False)");
  if (accumulated_[index]) {
    add_into(view, grad.detach());
  } else {
    view.copy_(grad.detach());
  }
  accumulated_[index] = 1;
  grad.reset();
}

std::vector<std::pair<size_t, at::Tensor>> MainGrads::save(const BucketLayout& layout) const {
  std::vector<std::pair<size_t, at::Tensor>> sums;
  for (size_t i = 0; i < accumulated_.size(); ++i) {
    if (accumulated_[i]) sums.emplace_back(i, layout.view(i).clone());
  }
  return sums;
}

void MainGrads::restore(const BucketLayout& layout,
                        const std::vector<std::pair<size_t, at::Tensor>>& sums) {
  for (const auto& [index, sum] : sums) {
    layout.view(index).copy_(sum);
    accumulated_[index] = 1;
  }
}

}  // namespace pycomm::reducer
