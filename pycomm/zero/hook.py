"""What a pycomm.ZeroRedundancyOptimizer that releases the gradients keeps of its DDP's
buckets (See Note [Sharding on the reducer] in binding.py): HookState, the optimizer's
side of the C++ ShardKeep, which reduces each bucket and keeps this rank's range of it
without a trip through Python (Note [Shards kept in C++] in csrc/reducer/shard_hook.h)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _C


class HookState:
    """The buckets' reductions and what they keep (`keep`, a _C.ShardKeep): per bucket
    index, the averaged gradients of this rank's range and of the tail, back to back (the
    optimizer's gradients; reused from step to step while the bucket keeps its size), and
    before the DDP's re-cut, per parameter, its whole averaged gradient."""

    def __init__(self, ddp: Any, group: dist.ProcessGroup, index: dict[int, int],
                 reduce_scatter: bool):
        """For the buckets of `ddp` (a pycomm DistributedDataParallel, read through its
        public methods) over its gradient group `group`; `index`: id(parameter) -> reducer
        index; `reduce_scatter`: whether the group's reduce-scatter is a real one. The
        buckets cross hosts in the DDP's wire (DDPConfig.wire_format), where the group
        spans hosts, with fp32 sums."""
        self.index = index
        self.keep = _C.ShardKeep(group, reduce_scatter, ddp.config.wire_format)
        # See Note [The first step's buckets] in binding.py: False while a re-cut is
        # still to come (the DDP records its first step: not with find_unused_parameters
        # alone); until then whole buckets are all-reduced and each parameter's gradient
        # kept whole
        self.final = ddp.config.find_unused_parameters and not ddp.config.static_graph

    @property
    def grads(self) -> dict[int, torch.Tensor]:
        """Per bucket index, what the rank keeps: its range, then the tail."""
        return self.keep.grads

    @property
    def fresh(self) -> set[int]:
        """The buckets reduced since the optimizer's zero_grad."""
        return self.keep.fresh

    def clear(self) -> None:
        """The optimizer's zero_grad: nothing reduced since."""
        self.keep.clear()


def shadow_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """A joined rank's shadow of the running ranks' bucket (pycomm/ddp/join.py; torch's
    hook protocol): the same collectives, through the same ShardKeep, which keeps this
    rank's range of the others' sums."""
    members = [state.index[id(p)] for p in bucket.parameters()]
    return state.keep.reduce(bucket.index(), bucket.buffer(), members,
                             [p.numel() for p in bucket.parameters()], state.final)
