"""What code written for torch's DistributedDataParallel reads off pycomm's: the
isinstance answer, the attributes Lightning, Accelerate and the HF Trainer touch, and the
methods of torch's c10d Reducer they call on `ddp.reducer`. The module itself, its
forward and its options stay in module.py; swapping torch's names is pycomm/patching.py's.

Note [Virtual subclass of torch's DDP]
pycomm's DistributedDataParallel is registered as a virtual subclass of torch's
(torch's class is an ABC through Joinable, so ABCMeta.register applies): isinstance and
issubclass answer True, and nothing of torch's class is inherited. A real subclass would
inherit ~60 torch methods (_pre_forward, _sync_buffers, _get_ddp_logging_data, ...) that
read state only torch's __init__ creates (self.logger, self.reducer as a c10d Reducer,
self.modules_buffers, ...); each one would have to be overridden or fenced, and every
torch release could add another. With a virtual subclass an attribute torch has and
pycomm lacks raises AttributeError instead of running torch code on a half-built object,
and this file lists what pycomm does provide. The cost: `super()` chains and `__mro__`
do not contain torch's class, which no library we know of relies on.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import DistributedDataParallel as _TorchDDP

from .. import _C

TORCH_DDP = _TorchDDP
"""torch's own DistributedDataParallel class, whatever pycomm.patch() later binds to
torch.nn.parallel.DistributedDataParallel."""


class TorchReducer(_C.Reducer):
    """pycomm's C++ reducer, plus the methods of torch's c10d Reducer that code written for
    torch's DDP calls on `ddp.reducer` from outside forward (Lightning's manual
    optimization, Accelerate's trigger_sync_in_backward, torch's pipelining stage).

    `prepare_for_backward(outputs)` is the C++ one: it arms the reducer so the next
    backward all-reduces every bucket, whatever the last forward was (no_sync included), as
    torch's does; `outputs` only matter with find_unused_parameters (the graph is searched
    from them; an empty list marks every parameter unused, which both reducers reject
    at the first gradient). It returns a note (empty unless an unfinished step was
    abandoned) where torch returns None.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._rebuild: weakref.WeakMethod | None = None

    def set_rebuild(self, rebuild: Callable[[], bool]) -> None:
        """The forward's bucket rebuild (forward.py's ForwardSync.rebuild_buckets_if_due),
        which _rebuild_buckets runs; held weakly, as its owner holds this reducer."""
        self._rebuild = weakref.WeakMethod(rebuild)

    def _rebuild_buckets(self) -> bool:
        """torch's: re-cut the buckets in the observed gradient order when due (once,
        after the first synchronized step); pycomm's forward does the same, so a call
        after it finds nothing due. Every rank must call it (it broadcasts rank 0's order)."""
        rebuild = None if self._rebuild is None else self._rebuild()
        return rebuild is not None and rebuild()

    def _delay_all_reduce(self) -> None:
        """torch's first static-graph step defers every all-reduce to this call after
        backward. pycomm's reducer reduces that step itself and waits for it at the end of
        backward, so when this is called the gradients are already reduced."""


def _bucket_bytes(ddp: Any) -> list[int]:
    params = [p for _, p in ddp._named_params]
    return [sum(params[i].numel() * params[i].element_size() for i in bucket)
            for bucket in ddp.reducer.bucket_indices()]


class TorchDDPAttributes:
    """torch's DDP attributes on pycomm's class (mixed into module.DistributedDataParallel,
    which it also registers as a virtual subclass of torch's: See Note [Virtual subclass
    of torch's DDP]). Reads come from the config and the reducer, never from a second copy."""

    _active_ddp_module = None
    """torch's class attribute of the same name (replicate() sets it for torch.compile).
    pycomm's forward sets torch's own (See Note [Graph split at pycomm's buckets] in
    compile.py), which _get_active_ddp_module answers with."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        TORCH_DDP.register(cls)

    @classmethod
    def _get_active_ddp_module(cls) -> Any:
        """torch's classmethod, which torch._dynamo calls on whatever class
        torch.nn.parallel.distributed.DistributedDataParallel names when it is imported,
        possibly this one after pycomm.patch(): either class answers alike."""
        return cls._active_ddp_module or TORCH_DDP._get_active_ddp_module()

    @property
    def static_graph(self) -> bool:
        return self.config.static_graph

    @property
    def find_unused_parameters(self) -> bool:
        return self.config.find_unused_parameters

    @property
    def gradient_as_bucket_view(self) -> bool:
        return self.config.gradient_as_bucket_view

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether buffers are broadcast before a forward (DDPConfig.broadcast_buffers)."""
        return self.config.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        # torch's is a plain attribute its forward reads each time: so is the config here.
        self.config = self.config.replace(broadcast_buffers=bool(value))

    broadcast_buffers = forward_sync_buffers  # torch's older name for the same option

    @property
    def batched_grad_copy(self) -> bool:
        return self.config.batched_grad_copy

    @property
    def bucket_bytes_cap(self) -> int:
        """The largest bucket cap in bytes (torch: bucket_cap_mb in bytes)."""
        return max(self.config.bucket_byte_limits())

    @property
    def parameters_to_ignore(self) -> set[str]:
        return self._ignored()

    def will_sync_module_buffers(self) -> bool:
        return (self.require_forward_param_sync and self.config.broadcast_buffers
                and bool(self._buffers_to_sync()))

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's construction-time logging keys with pycomm's values. Two of torch's
        runtime keys are left out: "iteration" and "can_set_static_graph" (torch sets the
        latter, to 0, only when find_unused_parameters saw the unused set change; Lightning
        reads it with .get to suggest static_graph=True)."""
        params = [p for _, p in self._named_params]
        data: dict[str, Any] = {
            "world_size": dist.get_world_size(self.process_group),
            "rank": dist.get_rank(self.process_group),
            "module_name": type(self.module).__name__,
            "device_ids": ",".join(map(str, self.device_ids or ())),
            "output_device": -1 if self.output_device is None else int(self.output_device),
            "backend_name": dist.get_backend(self.process_group),
            "gradient_backend_name": dist.get_backend(self.gradient_group),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "bucket_sizes": ", ".join(map(str, _bucket_bytes(self))),
            "find_unused_parameters": int(self.config.find_unused_parameters),
            "gradient_as_bucket_view": int(self.config.gradient_as_bucket_view),
            "broadcast_buffers": int(self.config.broadcast_buffers),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
            "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm)
                                   for m in self.module.modules())),
        }
        if self.config.static_graph:
            data["static_graph"] = 1
        return data

    def _set_static_graph(self) -> None:
        """torch's: switch to static_graph after construction, before the first step."""
        if self.config.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if any(p.grad is not None for _, p in self._named_params):
            raise RuntimeError("_set_static_graph() should be called before the training loop "
                               "starts and after DistributedDataParallel is constructed")
        if self.config.find_unused_parameters:
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "`_set_static_graph` will detect unused parameters automatically, so "
                          "you do not need to set find_unused_parameters=true, just be sure "
                          "these unused parameters will not change during training loop while "
                          "calling `_set_static_graph`.", stacklevel=2)
        if self.sharder is not None:
            raise RuntimeError("_set_static_graph() after a ZeroRedundancyOptimizer was built "
                               "on this DDP: pass static_graph=True to the DDP, or call "
                               "_set_static_graph() before building the optimizer")
        hook = self._sync.comm_hook
        self.config = self.config.replace(static_graph=True)
        self._build_reducer()
        if hook is not None:
            self.register_comm_hook(*hook)
