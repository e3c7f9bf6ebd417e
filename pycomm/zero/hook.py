"""The communication hook a pycomm.ZeroRedundancyOptimizer registers on its DDP: how a
bucket is reduced when the optimizer is sharded (See Note [Sharding on the reducer] in
binding.py), and what the hook keeps for the step (HookState)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _C
from .layout import Ranges

# torch 2.13 renamed the tensor form (the old name warns); torch 2.11 has only the old one.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class HookState:
    """What the communication hook needs, and what it keeps: per bucket index, the
    averaged gradients of this rank's range and of the tail, back to back (the optimizer's
    gradients; reused from step to step while the bucket keeps its size), and before the
    DDP's re-cut, per parameter, its whole averaged gradient."""

    def __init__(self, ddp: Any, group: dist.ProcessGroup, index: dict[int, int],
                 reduce_scatter: bool):
        """For the buckets of `ddp` (a pycomm DistributedDataParallel, read through its
        public methods) over its gradient group `group`; `index`: id(parameter) -> reducer
        index."""
        self.reduce_scatter = reduce_scatter
        # Free the bucket's storage once its shard is kept: the DDP's plan says, once the
        # hook is attached (not with grad_reduce_dtype, whose buckets hold no_sync's fp32
        # sums between steps: Note [main_grad accumulation])
        self.release = False
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.group = group
        self.index = index
        self.grads: dict[int, torch.Tensor] = {}
        self.fresh: set[int] = set()  # buckets reduced since the optimizer's zero_grad
        # See Note [The first step's buckets] in binding.py: False while a re-cut is
        # still to come (the DDP records its first step: not with find_unused_parameters
        # alone); until then whole buckets are all-reduced and each parameter's gradient
        # kept in `first`
        self._final = ddp.config.find_unused_parameters and not ddp.config.static_graph
        self.first: dict[int, torch.Tensor] = {}
        # The low-precision wire the DDP's buckets cross hosts in (DDPConfig.wire, where
        # the DDP's reducer puts it in effect: a group spanning hosts), which the bucket
        # collectives here carry too; None: float32. Its error-feedback residuals per
        # bucket index, restarted when the buckets are re-cut.
        self.wire: Optional[_C.Wire] = None
        wire = ddp.wire  # None under a comm hook: none is registered yet
        if wire is not None and not wire.exact:
            self.wire = wire
            self.backend = self.group._get_backend(torch.device("cpu"))
        self.residuals: dict[int, Any] = {}  # cleared by `final` and by a re-cut

    @property
    def final(self) -> bool:
        """See Note [The first step's buckets] in binding.py; once final, the optimizer
        attaches again with the hook's in-place form (its _attach_reduction)."""
        return self._final

    @final.setter
    def final(self, value: bool) -> None:
        self._final = value
        self.residuals.clear()  # the buckets are re-cut

    def clear(self) -> None:
        """The optimizer's zero_grad: nothing reduced since."""
        self.fresh.clear()
        self.first.clear()


def _wire_args(state: HookState, index: int, buf: torch.Tensor) -> Optional[dict]:
    """The arguments of bucket `index`'s wire collectives (HierBackend's allreduce_wire and
    reduce_scatter_wire), or None where the bucket crosses hosts in float32."""
    if state.wire is None or not buf.is_cpu:
        return None
    residual = state.residuals.get(index)
    if state.wire.error_feedback and residual is None:
        residual = state.residuals[index] = _C.WireResidual()
    return dict(wire=state.wire, residual=residual, async_op=True)


def _raise_failure(future: torch.futures.Future) -> None:
    """Raise a failed collective's error (each of collect_all's): the bucket's future then
    fails with it and the reducer reports the bucket; nothing is kept or freed."""
    value = future.value()
    if isinstance(value, list):
        for part in value:
            if isinstance(part, torch.futures.Future):
                part.value()


def _free(buf: torch.Tensor) -> None:
    """Free a bucket's storage (See Note [Released gradients] in
    csrc/reducer/launch.cpp); on CUDA not before this stream's work on it is done."""
    if buf.is_cuda:
        buf.record_stream(torch.cuda.current_stream(buf.device))
    buf.untyped_storage().resize_(0)


def _kept(state: HookState, index: int, buf: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """What the rank keeps of bucket `index` (buffer `buf`): its range and the tail, back to
    back, reused from step to step; and whether this backward's sums add to it (it holds
    an earlier synchronized backward's since the optimizer's zero_grad)."""
    mine = Ranges.of(buf.numel(), state.world, state.rank).kept
    out = state.grads.get(index)
    if out is None or out.numel() != mine or out.dtype != buf.dtype:
        out = state.grads[index] = torch.empty(mine, dtype=buf.dtype, device=buf.device)
        return out, False  # nothing kept to add to
    return out, index in state.fresh


def reduce_scatter_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The bucket collective of a sharded pycomm DDP (See Note [Sharding on the reducer] in
    binding.py):
    the reducer pre-divided the gradients (ShardHook), so the collectives sum them into
    the averages; the rank keeps its range and the tail (added to what it kept since
    zero_grad, as param.grad accumulates over several synchronized backwards)."""
    buf = bucket.buffer()
    group = state.group
    ranges = Ranges.of(buf.numel(), state.world, state.rank)
    index = bucket.index()
    if not state.final:  # See Note [The first step's buckets] in binding.py
        members = [(state.index[id(p)], p.numel()) for p in bucket.parameters()]

        def keep_whole(fut):
            _raise_failure(fut)
            at = 0
            for i, n in members:
                run = buf[at:at + n]
                at += n
                if i in state.first:
                    state.first[i] += run
                else:
                    state.first[i] = run.clone()
            if state.release:
                _free(buf)
            return buf

        wire = _wire_args(state, index, buf)
        if wire is not None:
            return state.backend.allreduce_wire(buf, **wire).then(keep_whole)
        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(keep_whole)
    # Unless it adds to what an earlier backward kept, or the bucket stays (not released:
    # its range must hold the average too), the reduce-scatter writes the range straight
    # into what the rank keeps (one pass over the range fewer than reducing in place and
    # copying).
    out, add = _kept(state, index, buf)
    direct = state.reduce_scatter and state.release and not add
    futures = []
    if state.reduce_scatter:
        wire = _wire_args(state, index, buf)
        range_out = out[ranges.kept_mine] if direct else buf[ranges.mine]
        if ranges.shard and wire is not None:
            futures.append(state.backend.reduce_scatter_wire(range_out, buf[ranges.ranges],
                                                             **wire))
        elif ranges.shard:
            futures.append(_reduce_scatter(range_out, buf[ranges.ranges], group=group,
                                           async_op=True).get_future())
        # the tail, fewer elements than ranks, in float32
        if ranges.tail_numel:
            futures.append(dist.all_reduce(buf[ranges.tail], group=group,
                                           async_op=True).get_future())
    elif buf.numel():
        futures.append(dist.all_reduce(buf, group=group, async_op=True).get_future())

    def keep(fut):
        if fut is not None:
            _raise_failure(fut)
        pairs = [(out[ranges.kept_tail], buf[ranges.tail])]
        if not direct:
            pairs.append((out[ranges.kept_mine], buf[ranges.mine]))
        for dst, src in pairs:
            dst.add_(src) if add else dst.copy_(src)
        state.fresh.add(index)
        if state.release:
            _free(buf)
        return buf

    if not futures:  # an empty bucket
        done = torch.futures.Future()
        done.set_result(keep(None))
        return done
    done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
    return done.then(keep)


def reduce_scatter_in_place_hook(state: HookState, bucket: dist.GradBucket,
                                 reduce_into: Any) -> torch.futures.Future:
    """reduce_scatter_hook for a bucket whose gradients the reducer left where they are
    (its in_place_hook; See ShardHook in csrc/reducer/comm_hook.h): reduce_into(out)
    reads them as one buffer, scaled as the copy into the bucket would have, and writes
    the rank's range and the tail's sum into `out` (Note [Pieces reduce-scatter] in
    csrc/shm/collectives.cpp); the reducer drops them once done (Note [Released
    gradients] in csrc/reducer/launch.cpp). The bucket's buffer is not needed: its
    storage is freed (a re-cut bucket still has it)."""
    index = bucket.index()
    buf = bucket.buffer()
    out, add = _kept(state, index, buf)
    into = torch.empty_like(out) if add else out

    def keep(fut):
        _raise_failure(fut)
        if add:
            out.add_(into)
        state.fresh.add(index)
        _free(buf)
        return buf

    return reduce_into(into).then(keep)
