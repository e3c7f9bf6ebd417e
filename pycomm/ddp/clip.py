"""DistributedDataParallel.clip_grad_norm_ (clipping the synchronized gradients from
per-bucket norms computed during backward) and the local clip before the all-reduce
(DDPConfig.local_clip_max_norm).

Note [Clip after vs before the all-reduce]
ddp.clip_grad_norm_ clips the synchronized (averaged) gradients: every rank sees the same
total norm and applies the same coefficient, exactly what torch users get from
all-reduce-then-clip_grad_norm_. Its per-bucket norm partials are computed while backward
still runs, so communication keeps overlapping backward.

DDPConfig(local_clip_max_norm=...) clips each rank's local gradients before the all-reduce
instead (Horovod users' other order): every rank's contribution is bounded by max_norm
before averaging, ranks' coefficients differ, and the averaged gradient is not clipped to
max_norm (its norm is at most max_norm, usually less; an outlier rank's batch cannot
dominate the step). It needs each rank's whole local norm before its first collective
starts, so it gives up overlap: no bucket launches during backward; at its end one fused
norm pass over all buckets, one scale pass (clip coefficient times 1/world), then every
bucket launches (See Note [Deferred launch] in csrc/reducer/deferred.cpp). The norm is of
the local (no_sync-accumulated) gradient; ddp.local_grad_norm() returns it. With a comm
hook, the hook receives the clipped local bucket and averages it itself, as usual.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _C, ops
from ..clip import _norm_dtype, clip_from_partial


def attach_local_clip(reducer, config) -> Optional[object]:
    """The reducer's launch gate clipping local gradients before the all-reduce (See Note
    [Clip after vs before the all-reduce]), when config.local_clip_max_norm is set."""
    if config.local_clip_max_norm is None:
        return None
    return _C.attach_local_clip(reducer, float(config.local_clip_max_norm),
                                float(config.local_clip_norm_type),
                                bool(config.local_clip_error_if_nonfinite))


def synced_grad(ddp, p: torch.Tensor) -> Optional[torch.Tensor]:
    """A parameter's synchronized gradient, what ddp.clip_grad_norm_ clips and an
    optimizer steps: param.grad, or param.main_grad where config.main_grad_only leaves
    param.grad None."""
    g = p.grad
    if g is None and ddp.config.main_grad_only:
        g = getattr(p, "main_grad", None)
    return g


def _synced_grads(ddp) -> list[torch.Tensor]:
    return [g for g in (synced_grad(ddp, p) for _, p in ddp._named_params) if g is not None]


@torch.no_grad()
def clip_ddp_grad_norm_(ddp, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
    """DistributedDataParallel.clip_grad_norm_: the first call attaches a post_done
    callback to the reducer (csrc/reducer/bucket_norms.cpp), so from the next synchronized
    backward on, each bucket's norm partial is computed the moment its collective
    completes; here the partials are merged and one scale pass runs. When they are not all
    there (first call, another norm_type, a second call in one step, the reducer rebuilt),
    the norm is computed from the synchronized gradients instead: same result, one more
    pass. Under no_sync nothing is computed: no collective runs. With a compressing comm
    hook, the partial is of the decompressed result (the reduced buffer). With
    grad_reduce_dtype, it is of the wide reduced buffer, i.e. before param.grad's rounding;
    with main_grad_only, the fp32 param.main_grad are what is scaled.
    """
    sharder = ddp.sharder
    if sharder is not None and sharder.grads_in_shards:  # the norm is the shards'
        return sharder.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
    norm_type = float(norm_type)
    grads = _synced_grads(ddp)
    partial = ddp._runtime.bucket_norm_partial(norm_type)
    if not grads:
        return torch.tensor(0.0)
    if partial is None:
        return ops.clip_grad_norm_(grads, max_norm, norm_type, error_if_nonfinite)
    return clip_from_partial(grads, partial, max_norm, norm_type, error_if_nonfinite,
                             _norm_dtype(grads))
