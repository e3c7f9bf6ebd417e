// pycomm::clip_grad_norm_: torch.nn.utils.clip_grad_norm_ composed from the fused ops in one
// call, so a list of a thousand gradients crosses from Python once. Device-independent: it
// calls norm_partial and scale_ through the dispatcher, which picks the CPU or CUDA
// kernels, and ends with the one finish (See Note [One clip finish] in clip.h). Host
// syncs: none, except the check error_if_nonfinite asks for (as torch).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/maximum.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <vector>

#include "grad/clip.h"
#include "grad/grad_math.h"

namespace pycomm {
namespace {

at::Tensor call_norm_partial(at::TensorList ts, double norm_type) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::norm_partial", "")
                       .typed<at::Tensor(at::TensorList, double)>();
  return op.call(ts, norm_type);
}

void call_scale(at::TensorList ts, const at::Tensor& factor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pycomm::scale_", "")
                       .typed<void(at::TensorList, const at::Tensor&)>();
  op.call(ts, factor);
}

// The gradients split by device, first-seen order (usually one group: then no copy).
struct DeviceGroups {
  std::vector<c10::Device> devices;
  std::vector<std::vector<at::Tensor>> tensors;
};

DeviceGroups split_by_device(at::TensorList grads) {
  DeviceGroups g;
  for (const auto& t : grads) {
    size_t i = 0;
    while (i < g.devices.size() && g.devices[i] != t.device()) ++i;
    if (i == g.devices.size()) {
      g.devices.push_back(t.device());
      g.tensors.emplace_back();
    }
    g.tensors[i].push_back(t);
  }
  return g;
}

// The dtype torch's total norm has: per-tensor norms keep their gradient's dtype, and
// torch.stack promotes them.
at::ScalarType norm_dtype(at::TensorList grads) {
  at::ScalarType dtype = grads[0].scalar_type();
  for (const auto& t : grads) dtype = c10::promoteTypes(dtype, t.scalar_type());
  return dtype;
}

}  // namespace

const CudaClip*& cuda_clip() {
  static const CudaClip* registered = nullptr;
  return registered;
}

at::Tensor clip_grad_norm_impl(at::TensorList grads, double max_norm, double norm_type,
                               bool error_if_nonfinite) {
  constexpr const char* op = "pycomm::clip_grad_norm_";
  TORCH_CHECK(!grads.empty(), op, ": grads must hold at least one tensor");
  // Clipping is not differentiable, and this composite already runs below autograd: skip
  // the Autograd and ADInplaceOrView keys for the ops it calls. Their fallbacks are boxed,
  // i.e. every Tensor[] argument would be converted to IValues one tensor at a time
  // (1,000 gradients of 1,024 elements, 1 thread: ~300 us per clip with them, ~160 without).
  c10::impl::ExcludeDispatchKeyGuard below_autograd(
      c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  for (size_t i = 0; i < grads.size(); ++i)
    TORCH_CHECK(at::isFloatingType(grads[i].scalar_type()), op, ": grads[", i,
                "] must be a floating-point tensor, got ", grads[i].scalar_type());
  const NormKind kind = norm_kind(norm_type, op);
  const bool one_device = std::all_of(grads.begin(), grads.end(), [&](const at::Tensor& t) {
    return t.device() == grads[0].device();
  });
  if (one_device && grads[0].is_cuda() && !error_if_nonfinite && cuda_clip() != nullptr) {
    // See Note [Tile plans]: the coefficient never leaves the device, so one pass each
    std::vector<size_t> strided;
    bool dense = true;
    for (const auto& g : grads) dense = dense && is_flat_span(g);
    if (dense) {
      const SpanList l = write_spans(grads, strided);
      return cuda_clip()->clip(l, grads[0].device(), max_norm, norm_type, norm_dtype(grads));
    }
  }
  const DeviceGroups groups = one_device ? DeviceGroups{} : split_by_device(grads);
  at::Tensor partial;
  if (one_device) {
    partial = call_norm_partial(grads, norm_type);
  } else {  // merge per-device partials on the first device. See Note [Norm partials]
    for (const auto& ts : groups.tensors) {
      const auto p = call_norm_partial(ts, norm_type).to(groups.devices[0]);
      partial = !partial.defined()       ? p
                : kind == NormKind::kInf ? at::maximum(partial, p)
                                         : at::add(partial, p);
    }
  }
  auto [total, coef] = finish_clip(partial, max_norm, norm_type, error_if_nonfinite,
                                   norm_dtype(grads));
  if (one_device) {
    call_scale(grads, coef);
  } else {
    for (size_t i = 0; i < groups.devices.size(); ++i)
      call_scale(groups.tensors[i], coef.to(groups.devices[i]));
  }
  return total;
}

TORCH_LIBRARY_IMPL(pycomm, CompositeExplicitAutograd, m) {
  m.impl("clip_grad_norm_", &clip_grad_norm_impl);
}

}  // namespace pycomm
