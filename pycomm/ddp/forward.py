"""The collectives that keep pycomm's DDP ranks in step around each forward, for one
reducer: the one-time bucket rebuild, the buffer broadcast, join's sync flag and common
rank, and the join context's notice. The DDP module (module.py) runs them before and after
its module's call; a joined rank's hook (join.py) runs the same ones in the same order.
Neither the module's flags nor its options live here: callers pass what they decide."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from .. import _C
from ..config import BROADCAST_BUCKET_BYTES, DDPConfig
from .compat import TorchReducer
from .construction import NamedParams, buffers_to_sync, params_to_sync


class ForwardSync:
    """What one DDP module's forward does across ranks besides running the module, built
    with its reducer (and rebuilt with it). `comm_hook` is the registered (state, hook)."""

    def __init__(self, reducer: TorchReducer, module: nn.Module, delayed_names: set[str],
                 named_params: NamedParams, process_group: dist.ProcessGroup,
                 gradient_group: dist.ProcessGroup, device: torch.device, config: DDPConfig):
        self.reducer = reducer
        self.module = module
        self.delayed_names = delayed_names
        self.params = [p for _, p in named_params]
        self.process_group = process_group
        self.gradient_group = gradient_group
        self.device = device
        self.comm_hook: Optional[tuple[Any, Callable]] = None
        self.config = config  # read at each use, as the wrapper's own config
        reducer.set_rebuild(self.rebuild_buckets_if_due)
        self.set_main_grads()

    def params_to_sync(self) -> NamedParams:
        return params_to_sync(self.module, self.delayed_names)

    def buffers_to_sync(self) -> list[torch.Tensor]:
        return buffers_to_sync(self.module, self.delayed_names)

    def set_main_grads(self) -> None:
        """param.main_grad: the reducer's wide gradient view, where grad_reduce_dtype makes it
        wider than the parameter."""
        if self.config.grad_reduce_dtype is None:
            return
        for i, p in enumerate(self.params):
            view = self.reducer.grad_view(i)
            if view.dtype != p.dtype:
                p.main_grad = view

    def rebuild_buckets_if_due(self) -> bool:
        """Once, after the first synchronized step (See Note [Bucket rebuild] in
        csrc/reducer/rebuild.h): buckets re-cut in rank 0's observed gradient-ready order,
        a burst of gradients from one autograd node split across buckets only where each
        part fills one (See Note [Gradient groups] in csrc/reducer/rebuild.cpp);
        broadcast, so every rank gets the same layout."""
        if not self.reducer.should_rebuild_buckets():
            return False
        seen = torch.tensor([self.reducer.ready_order(), self.reducer.ready_groups()],
                            dtype=torch.int64, device=self.device)
        group = self.gradient_group
        dist.broadcast(seen, dist.get_global_rank(group, 0), group=group)
        order, groups = seen.cpu().tolist()
        assignment = _C.assign_buckets(self.params, order, self.config.bucket_byte_limits(),
                                       groups)
        # param.main_grad holds the last synchronized backward's average until the next
        # backward, across the re-cut too: a step between the two (a sharded optimizer's,
        # which re-cuts first) reads it
        kept = [(p, p.main_grad.clone()) for p in self.params if hasattr(p, "main_grad")] \
            if self.config.grad_reduce_dtype is not None else []
        self.reducer.rebuild_buckets(assignment)
        self.set_main_grads()
        with torch.no_grad():
            for p, value in kept:
                p.main_grad.copy_(value)
        return True

    def sync_buffers(self, authoritative: bool, join_enabled: bool) -> None:
        """Broadcast the module's buffers: from rank 0, or under join from the highest rank
        that is `authoritative` (one that still has data)."""
        if dist.get_world_size(self.process_group) == 1:  # before the walk over the module
            return
        buffers = self.buffers_to_sync()
        if not buffers:
            return
        src = self.common_rank(authoritative) if join_enabled else 0
        # As torch: the broadcast does not bump the buffers' version counters, so a graph
        # that saved a buffer for backward is not invalidated by it.
        with torch.no_grad(), ExitStack() as keep:
            for b in buffers:  # one tensor each: torch < 2.6 takes no tuple here
                keep.enter_context(torch.autograd._unsafe_preserve_version_counter(b))
            dist._broadcast_coalesced(self.process_group, buffers, BROADCAST_BUCKET_BYTES,
                                      src)

    def common_rank(self, condition: bool) -> int:
        """The highest rank for which `condition` holds (torch's _find_common_rank)."""
        rank = dist.get_rank(self.process_group)
        t = torch.tensor([rank if condition else -1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        common = int(t.item())
        if common < 0:
            raise RuntimeError("join: no rank satisfied the condition (internal error)")
        return common

    def requires_sync(self, this_rank: bool) -> bool:
        """Whether any rank will synchronize gradients this step (join's sync flag); a joined
        rank passes False."""
        flag = (torch.ones(1, device=self.device) if this_rank
                else torch.zeros(1, device=self.device))
        dist.all_reduce(flag, group=self.process_group)
        return bool(flag.item() != 0)

    def notify_join(self, joinable: Joinable, divide_by_initial_world_size: bool) -> None:
        """Forward of a rank that still has data: tell the join context, and when gradients
        are averaged over the ranks still running, learn how many they are."""
        work = Join.notify_join_context(joinable)
        if work is None or divide_by_initial_world_size:
            return
        work.wait()
        self.reducer.set_divide_factor(int(work.result()[0].item()))
