"""Uneven inputs for pycomm's DDP (torch's Join/Joinable protocol): a rank that ran out of
data shadows, each iteration the others still run, every collective of their forward and
backward (bucket rebuild, buffer sync, the sync flag, one all-reduce per bucket in bucket
order through the registered comm hook, the usage map), so nobody hangs. Mirrors the
sequence of torch's _DDPJoinHook so that the two can be swapped one for the other."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from .config import BROADCAST_BUCKET_BYTES

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


def notify_join(ddp: DistributedDataParallel) -> None:
    """Forward of a rank that still has data: tell the join context, and when gradients are
    averaged over the ranks still running, learn how many they are."""
    work = Join.notify_join_context(ddp)
    if work is None or ddp._join_divide_by_initial_world_size:
        return
    work.wait()
    ddp.reducer.set_divide_factor(int(work.result()[0].item()))


def _shadow_backward(ddp: DistributedDataParallel) -> None:
    """The collectives of one synchronized backward, with zero gradients, in bucket order
    (see Note [Bucket order] in csrc/reducer/reducer.cpp), preceded by the non-finite flag
    all-reduce of local clipping (Note [Non-finite local norm] in csrc/grad/local_clip.cpp)."""
    if ddp.config.local_clip_error_if_nonfinite:
        flags = torch.zeros(dist.get_world_size(ddp._gradient_pg), dtype=torch.float32,
                            device=ddp.device)
        dist.all_reduce(flags, group=ddp._gradient_pg)
    buckets = ddp.reducer.zeros_like_grad_buckets()
    if ddp._comm_hook is None:
        pending = [dist.all_reduce(b.buffer(), group=ddp._gradient_pg, async_op=True)
                   for b in buckets]
    else:
        state, hook = ddp._comm_hook
        pending = [hook(state, b) for b in buckets]
    for p in pending:
        p.wait()
    used = None
    if ddp.reducer.tracks_usage():  # exactly when the running ranks reduce usage this step
        used = torch.zeros(len(ddp._named_params), dtype=torch.int32, device=ddp.device)
        dist.all_reduce(used, group=ddp._gradient_pg)
    ddp.reducer.note_shadowed_step(used)


class DDPJoinHook(JoinHook):
    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._join_divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._rebuild_buckets_if_due()
        if ddp.config.broadcast_buffers and ddp.require_forward_param_sync:
            ddp._sync_buffers(authoritative=False)
        should_sync = ddp._join_requires_sync(joined=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            _shadow_backward(ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank ends with the model of the last rank to join."""
        ddp = self.ddp
        src = ddp._find_common_rank(is_last_joiner)
        states = [p.detach() for _, p in ddp._params_to_sync()]
        if ddp.config.broadcast_buffers:
            states += ddp._buffers_to_sync()
        with torch.no_grad():
            dist._broadcast_coalesced(ddp.process_group, states, BROADCAST_BUCKET_BYTES, src)
        ddp.reducer.set_divide_factor(dist.get_world_size(ddp._gradient_pg))
        ddp.require_forward_param_sync = True
