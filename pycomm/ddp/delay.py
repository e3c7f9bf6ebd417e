"""torch's `delay_all_reduce_named_params` + `param_to_hook_all_reduce` for pycomm's DDP.

The named parameters leave the reducer (like ignored ones). Their grads live in one flat
buffer: at the end of each forward every such param.grad that is None becomes its view
into it (all None: the buffer is zeroed; else only the new views are). When the gradient
of `param_to_hook_all_reduce` is computed in backward, the buffer is divided by the world
size and all-reduced asynchronously, as torch does. Two deliberate differences from torch:
the end of that backward waits for the all-reduce (torch drops the work handle, so grads
may still be in flight when backward returns), and a backward of a forward run under
no_sync() (or without grad) does not reduce them (torch reduces, and divides, every time).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import BROADCAST_BUCKET_BYTES


class DelayedAllReduce:
    """The delayed parameters' flat buffer and the hook that all-reduces it on `group`.
    The hook lives as long as `owner` (the DDP module): once that is collected, the
    parameter's gradient hook is removed."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], hook_param: nn.Parameter,
                 group: dist.ProcessGroup, owner: object):
        if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad:
            raise ValueError("param_to_hook_all_reduce must be a parameter that requires grad")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise ValueError(f"delay_all_reduce_named_params must share one dtype and device "
                             f"(their flat buffer); got {sorted(map(str, kinds))} for "
                             f"{self.names}")
        dtype, device = kinds.pop()
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=dtype,
                                  device=device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.armed = False
        self._work: Optional[dist.Work] = None
        self._group = group
        self._handle = hook_param.register_hook(self._on_hook_grad)
        self._owner_gone = weakref.finalize(owner, self._handle.remove)
        self._owner_gone.atexit = False

    def broadcast(self) -> None:
        """Rank 0's values, as torch broadcasts them at construction."""
        dist._broadcast_coalesced(self._group, [p.detach() for p in self.params],
                                  BROADCAST_BUCKET_BYTES, 0)

    def after_forward(self, grad_sync: bool) -> None:
        """torch's _clear_grad_buffer, and arm the all-reduce of a synchronized step."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()
        self.armed = grad_sync

    def _on_hook_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return grad
        self.armed = False
        self.buffer.div_(dist.get_world_size(self._group))
        self._work = dist.all_reduce(self.buffer, group=self._group, async_op=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return grad

    def _finish(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def remove(self) -> None:
        self._owner_gone.detach()
        self._handle.remove()
