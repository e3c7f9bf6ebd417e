"""Gradient clipping by total norm: pycomm.clip_grad_norm_, a drop-in for
torch.nn.utils.clip_grad_norm_ built on the fused ops (one C++ call per step however many
gradients there are; the norm pass and the scale pass are the only passes over memory,
and the scale pass is skipped when the coefficient is 1), and the bucket-aware variant
behind DistributedDataParallel.clip_grad_norm_.

Note [Clip after vs before the all-reduce]
ddp.clip_grad_norm_ clips the synchronized (averaged) gradients: every rank sees the same
total norm and applies the same coefficient, exactly what torch users get from
all-reduce-then-clip_grad_norm_. Clipping each rank's local gradients before the
all-reduce (Horovod users' other order) bounds every rank's contribution instead: ranks'
coefficients differ, and the averaged result is not clipped to max_norm (its norm is at
most max_norm, usually less). That order needs each rank's whole local norm before its
first bucket's collective starts, i.e. no overlap of communication with backward; pycomm
does not offer it as a DDP option yet. Outside DDP it is pycomm.clip_grad_norm_ on the
local gradients followed by your own all-reduce.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable
from typing import Optional, Union

import torch

from . import _C, ops

_Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]


@torch.no_grad()
def clip_grad_norm_(parameters: _Tensors, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
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
    # Reads every .grad in C++ and runs the pycomm::clip_grad_norm_ composite unboxed: see
    # csrc/grad/clip_bind.cpp for why this is not a torch.ops call.
    return _C._clip_grad_norm_(parameters, float(max_norm), float(norm_type),
                               bool(error_if_nonfinite))


def _norm_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    dtype = grads[0].dtype
    for g in grads[1:]:
        dtype = torch.promote_types(dtype, g.dtype)
    return dtype


@torch.no_grad()
def clip_ddp_grad_norm_(ddp, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
    """DistributedDataParallel.clip_grad_norm_: the first call attaches a post_done
    callback to the reducer (csrc/grad/bucket_norms.cpp), so from the next synchronized
    backward on, each bucket's norm partial is computed the moment its collective
    completes; here the partials are merged and one scale pass runs. When they are not all
    there (first call, another norm_type, a second call in one step, the reducer rebuilt),
    the norm is computed from the synchronized gradients instead: same result, one more
    pass. Under no_sync nothing is computed: no collective runs. With a compressing comm
    hook, the partial is of the decompressed result (the reduced buffer). With
    grad_reduce_dtype, it is of the wide reduced buffer, i.e. before param.grad's rounding.
    """
    norm_type = float(norm_type)
    params = [p for _, p in ddp._named_params if p.grad is not None]
    attached = getattr(ddp, "_bucket_norms", None)
    partial = None
    if attached is not None and attached[0] is ddp.reducer:
        norms = attached[1]
        partial = norms.take(len(ddp.reducer.bucket_indices()), norm_type)
        norms.set_norm_type(norm_type)
    else:
        ddp._bucket_norms = (ddp.reducer, _C.attach_bucket_norms(ddp.reducer, norm_type))
    if partial is None or not params:
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    grads = [p.grad for p in params]
    total, coef = ops.clip_coef(partial, norm_type, max_norm, _norm_dtype(grads))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    ops.scale_(grads, coef)
    return total
