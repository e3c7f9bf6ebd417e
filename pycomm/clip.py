"""Gradient clipping by total norm: pycomm.clip_grad_norm_, a drop-in for
torch.nn.utils.clip_grad_norm_ built on the fused ops (one C++ call per step however many
gradients there are; the norm pass and the scale pass are the only passes over memory,
and the scale pass is skipped when the coefficient is 1). The bucket-aware variant behind
DistributedDataParallel.clip_grad_norm_ is pycomm/ddp/clip.py.

Note [Clipping from partials]
A clip whose gradients are spread (over buckets, over ranks) merges norm partials
(pycomm.ops.norm_partial: [sum |g|^p or max |g|, nonfinite]), then clip_from_partial
finishes and scales: the norm and coefficient, rounded as torch rounds them, and torch's
non-finite refusal come from the one finish every clip ends with, C++'s finish_clip
(pycomm._C._finish_clip; See Note [One clip finish] in csrc/grad/clip.h).
DistributedDataParallel.clip_grad_norm_ merges its reduced buckets' partials; the sharded
optimizer with released gradients all-reduces each rank's partial of its shards.
pycomm.clip_grad_norm_ on whole gradients does the same in one C++ call
(csrc/grad/clip.cpp).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _C, ops, registry

_Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]


@torch.no_grad()
def clip_grad_norm_(parameters: _Tensors, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                    pp_mesh: Optional[Union[DeviceMesh, dist.ProcessGroup]] = None
                    ) -> torch.Tensor:
    """Clip the gradient norm of an iterable of parameters, in place.

    Same contract as :func:`torch.nn.utils.clip_grad_norm_`: the norm is taken over all
    gradients as if concatenated into one vector; gradients are multiplied by
    ``min(max_norm / (total_norm + 1e-6), 1)``; the total norm is returned as a tensor on
    the first gradient's device, in the dtype torch returns (the promotion of the
    gradients' dtypes). Low-precision gradients accumulate in float32, so half/bfloat16
    norms are at least as accurate as torch's.

    Differences, by design: no host sync unless ``error_if_nonfinite`` (as torch); the
    scale pass does not touch memory when the coefficient is 1; ``norm_type`` must be
    > 0 or inf (torch also accepts 0 and negative orders, which do not occur in clipping);
    ``foreach`` is accepted for signature compatibility and ignored (the fused path is
    always taken); gradients must be on CPU or CUDA devices. Non-contiguous gradients are
    handled (dense layouts in place, strided views through a copy for the norm and torch's
    ``mul_`` for the scale). Under torch.compile, or for gradient tensors rather than
    parameters, use :func:`pycomm.ops.clip_grad_norm_`.

    DTensor gradients (FSDP2's ``fully_shard``, ``replicate``, HSDP and tensor-parallel
    meshes, parameters on several meshes) take one fused pass over this rank's local
    tensors and one all-reduce per mesh dimension they are sharded on (See Note [Clipping
    sharded gradients] in pycomm/fsdp/clip.py); the norm is returned as torch returns it, a
    DTensor replicated on their mesh (a plain tensor when they span several meshes, which
    torch's clip refuses). ``pp_mesh`` (a 1-D DeviceMesh or a ProcessGroup over the
    pipeline stages, whose ranks hold different parameters; not an argument of torch's
    clip) adds the stages' norms, so every stage clips by the whole model's norm.
    """
    del foreach  # one fused path serves both of torch's code paths
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          stacklevel=3)
    if pp_mesh is not None:
        return _clip_sharded(parameters, max_norm, norm_type, error_if_nonfinite, pp_mesh)
    ddp = registry.ddp_of(parameters[0]) if parameters else None
    sharder = None if ddp is None else ddp.sharder
    if sharder is not None and sharder.grads_in_shards and sharder.covers(parameters):
        return sharder.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, parameters)
    if ddp is not None and ddp.config.main_grad_only:
        # the step reads param.main_grad there, param.grad being None: clip that
        return _clip_synced(parameters, max_norm, norm_type, error_if_nonfinite)
    # Reads every .grad in C++: plain CPU gradients are clipped right there, anything else
    # by the pycomm::clip_grad_norm_ composite, unboxed. See csrc/grad/clip_bind.cpp for
    # why this is not a torch.ops call. None: a gradient is a tensor subclass.
    total = _C._clip_grad_norm_(parameters, float(max_norm), float(norm_type),
                                bool(error_if_nonfinite))
    if total is not None:
        return total
    return _clip_sharded(parameters, max_norm, norm_type, error_if_nonfinite, None)


def _clip_synced(parameters: list[torch.Tensor], max_norm: float, norm_type: float,
                 error_if_nonfinite: bool) -> torch.Tensor:
    """The clip of what an optimizer steps on (DistributedDataParallel.synced_grad: the
    fp32 param.main_grad under DDPConfig.main_grad_only, else param.grad), per parameter
    as its DDP says."""
    grads = []
    for p in parameters:
        ddp = registry.ddp_of(p)
        grad = p.grad if ddp is None else ddp.synced_grad(p)
        if grad is not None:
            grads.append(grad)
    if not grads:
        return torch.tensor(0.0)  # as torch returns with no gradient
    return ops.clip_grad_norm_(grads, max_norm, norm_type, error_if_nonfinite)


def _clip_sharded(parameters: list[torch.Tensor], max_norm: float, norm_type: float,
                  error_if_nonfinite: bool,
                  pp_mesh: Optional[Union[DeviceMesh, dist.ProcessGroup]]) -> torch.Tensor:
    """DTensor gradients, or any gradients clipped across pipeline stages: pycomm/fsdp/clip.py
    (which hands other tensor subclasses to the pycomm::clip_grad_norm_ op)."""
    from .fsdp.clip import clip_dtensor_grads_

    return clip_dtensor_grads_(parameters, max_norm, norm_type, error_if_nonfinite, pp_mesh)


def clip_from_partial(grads: list[torch.Tensor], partial: torch.Tensor, max_norm: float,
                      norm_type: float, error_if_nonfinite: bool,
                      norm_dtype: torch.dtype) -> torch.Tensor:
    """Scale `grads` by the clip coefficient of the merged norm `partial` (See Note
    [Clipping from partials]); the total norm, in `norm_dtype`."""
    total, coef = _C._finish_clip(partial, float(max_norm), float(norm_type),
                                  bool(error_if_nonfinite), norm_dtype)
    if grads:
        ops.scale_(grads, coef)
    return total


def _norm_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    dtype = grads[0].dtype
    for g in grads[1:]:
        dtype = torch.promote_types(dtype, g.dtype)
    return dtype
