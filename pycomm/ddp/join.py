"""Uneven inputs for pycomm's DDP (torch's Join/Joinable protocol): a rank that ran out of
data shadows, each iteration the others still run, every collective of their forward and
backward (bucket rebuild, buffer sync, the sync flag, one all-reduce per bucket in bucket
order through the registered comm hook, the usage map), so nobody hangs. Mirrors the
sequence of torch's _DDPJoinHook so that the two can be swapped one for the other.

The hook is given a getter of the DDP module's current ForwardSync (forward.py: its reducer,
groups and the collectives of a forward) and the module's public torch flags (JoinFlags); it
imports nothing of the module itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from .. import _C
from ..config import BROADCAST_BUCKET_BYTES, DDPConfig
from .forward import ForwardSync
from .sharding import Sharder


class JoinFlags(Protocol):
    """The DDP module's attributes a joined rank reads and sets: torch's public ones, and
    the sharded optimizer attached to it."""
    config: DDPConfig
    require_forward_param_sync: bool
    sharder: Optional[Sharder]


def _shadow_backward(sync: ForwardSync, nonfinite_flag: bool, hand_over: bool) -> None:
    """The collectives of one synchronized backward, with zero gradients, in bucket order
    (see Note [Bucket order] in csrc/reducer/launch.cpp), preceded by the non-finite flag
    all-reduce of local clipping (Note [Non-finite local norm] in csrc/reducer/local_clip.cpp)
    and, on a Gloo group, the step's label exchange (Note [Step labels over the group] in
    csrc/comm/step_label.cpp). With `hand_over`, the averages go to param.grad (_hand_over)."""
    group, reducer = sync.gradient_group, sync.reducer
    if nonfinite_flag:
        flags = torch.zeros(dist.get_world_size(group), dtype=torch.float32,
                            device=sync.device)
        dist.all_reduce(flags, group=group)
    pending = []
    labels = reducer.step_label_elements()
    if labels:  # the step's label exchange, zeros: no label (Note [Step labels over the group])
        pending.append(dist.all_reduce(torch.zeros(labels, dtype=torch.int64), group=group,
                                       async_op=True))
    buckets = reducer.zeros_like_grad_buckets()
    wire = reducer.wire  # None under a comm hook
    if sync.comm_hook is None and wire is not None and not wire.exact:
        # the running ranks' buckets cross hosts in the wire (DDPConfig.wire): the same
        # collectives, queued behind the label exchange; zeros need no error feedback
        backend = group._get_backend(sync.device)
        for b in buckets:
            backend.allreduce_wire(b.buffer(), _C.Wire(wire.dtype))
        results = [b.buffer() for b in buckets]
    elif sync.comm_hook is None:
        pending += [dist.all_reduce(b.buffer(), group=group, async_op=True) for b in buckets]
        results = [b.buffer() for b in buckets]
    else:
        state, hook = sync.comm_hook
        pending += [hook(state, b) for b in buckets]
        results = None
    reduced = [p.wait() for p in pending]
    if results is None:  # a hook's futures hold the reduced buckets (torch's protocol)
        results = [r[0] if isinstance(r, list) else r for r in reduced[len(reduced) -
                                                                       len(buckets):]]
    used = None
    if reducer.tracks_usage():  # exactly when the running ranks reduce usage this step
        used = torch.zeros(len(sync.params), dtype=torch.int32, device=sync.device)
        dist.all_reduce(used, group=group)
    reducer.note_shadowed_step(used)
    if hand_over:
        _hand_over(sync, buckets, results, used)


def _hand_over(sync: ForwardSync, buckets: list, results: list,
               used: Optional[torch.Tensor]) -> None:
    """The joined rank's param.grad gets the average the running ranks reduced (its own
    share zeros), as if it had run the backward: what a sharded optimizer keeping
    torch's contract steps in its shadow of the step (ZeroRedundancyOptimizer's join
    hook: its shard must stay current), which then drops it. A parameter no rank used, or
    one that no longer requires a gradient, gets none, as on the running ranks. torch's
    DDP leaves a joined rank's param.grad as it was."""
    index = {id(p): i for i, p in enumerate(sync.params)}
    with torch.no_grad():
        for bucket, result in zip(buckets, results):
            at = 0
            for p in bucket.parameters():
                n = p.numel()
                grad = result.reshape(-1)[at:at + n].view(p.shape)
                at += n
                unused = used is not None and int(used[index[id(p)]]) == 0
                if unused or not p.requires_grad:
                    continue
                p.grad = grad.clone() if grad.dtype == p.dtype else grad.to(p.dtype)


class DDPJoinHook(JoinHook):
    def __init__(self, sync: Callable[[], ForwardSync], flags: JoinFlags):
        # A getter, asked at each hook: the wrapper's ForwardSync is rebuilt with its reducer
        # (_set_static_graph), and a joined rank must shadow the reducer the others run.
        self.sync = sync
        self.flags = flags

    def main_hook(self) -> None:
        sync, flags = self.sync(), self.flags
        sync.rebuild_buckets_if_due()
        if flags.config.broadcast_buffers and flags.require_forward_param_sync:
            sync.sync_buffers(authoritative=False, join_enabled=True)
        should_sync = sync.requires_sync(this_rank=False)
        flags.require_forward_param_sync = should_sync
        if should_sync:
            sharder = flags.sharder  # See _hand_over
            _shadow_backward(sync, flags.config.local_clip_error_if_nonfinite,
                             hand_over=sharder is not None and not sharder.grads_in_shards)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank ends with the model of the last rank to join."""
        sync, flags = self.sync(), self.flags
        sharder = flags.sharder
        if sharder is not None:  # its all-gathers write the parameters broadcast here
            sharder.wait_for_params()
        src = sync.common_rank(is_last_joiner)
        states = [p.detach() for _, p in sync.params_to_sync()]
        if flags.config.broadcast_buffers:
            states += sync.buffers_to_sync()
        with torch.no_grad():
            dist._broadcast_coalesced(sync.process_group, states, BROADCAST_BUCKET_BYTES, src)
        sync.reducer.set_divide_factor(dist.get_world_size(sync.gradient_group))
        flags.require_forward_param_sync = True
