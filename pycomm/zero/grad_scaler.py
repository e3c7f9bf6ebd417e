"""pycomm.ShardedGradScaler: torch.amp.GradScaler for gradients that live in a
pycomm.ZeroRedundancyOptimizer's shards.

Note [Loss scaling over shards]
torch's GradScaler unscales param.grad of the optimizer's parameters and records, per
device, whether any was not finite; step() then skips the optimizer's step where one
was. On a sharded DDP param.grad is None after a synchronized backward (Note [Sharding
on the reducer] in optimizer.py): the gradients are the shards, and each rank holds its
own range only, so a gradient that overflowed lands on the one rank that owns it. A
scaler that looked only there would let that rank skip the step while the others took
it, and the replicas would part. This scaler asks the optimizer instead
(ZeroRedundancyOptimizer.unscale_shards_): every gradient run the rank holds is checked
and unscaled by torch's own kernel (the same bits as unscaling whole gradients), and
the found-inf flag is all-reduced (max) over the optimizer's group, so every rank skips
or steps alike and update() moves every rank's scale alike. It is the role torch's
ShardedGradScaler plays for FSDP, through the same method. For any other optimizer it
is torch's GradScaler.
"""

from __future__ import annotations

import torch


class ShardedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler (same constructor, same use: scale, unscale_, step, update,
    state_dict) that also scales a pycomm.ZeroRedundancyOptimizer's sharded gradients:
    See Note [Loss scaling over shards]."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        unscale = getattr(optimizer, "unscale_shards_", None)
        if unscale is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return unscale(inv_scale, found_inf, allow_fp16)


__all__ = ["ShardedGradScaler"]
