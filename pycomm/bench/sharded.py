"""The optimizers of `pycomm-bench ddp`, and its sharded implementations: pycomm's
ZeroRedundancyOptimizer on pycomm's DDP, keeping param.grad ("pycomm_zero", the default
mode) or releasing it ("pycomm_zero_released"), torch's ZeroRedundancyOptimizer
on torch's DDP ("torch_zero") and torch's FSDP2 ("fsdp2": fully_shard on every top-level
block and the root, reshard_after_forward=False, the ZeRO-2 shape that keeps parameters
between forward and backward). What differs between them, for the step loop in ddp.py:
how each is built, how it accumulates without communicating (no_sync), and how much
optimizer state a rank holds."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from .. import optim as pycomm_optim
from ..config import DDPConfig
from ..ddp import DistributedDataParallel as PycommDDP
from ..overlap import StepReport
from ..zero import ZeroRedundancyOptimizer
from ..zero.gathers import attach

# adamw_fused: torch's fused kernel (CUDA, or CPU) for every implementation, the sharded
# ones stepping their flat pieces with it: the fastest AdamW a GPU user picks.
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 1e-6}), "adamw": (torch.optim.AdamW, {"lr": 1e-4}),
              "adamw_fused": (torch.optim.AdamW, {"lr": 1e-4, "fused": True})}
# pycomm_zero_released on a DDP whose gradients cross hosts in a low-precision wire
# (DDPConfig.wire), which its reduce-scatter carries: for --hosts runs, with --impls.
ZERO_WIRES = {"pycomm_zero_released_wire_bf16": "bf16", "pycomm_zero_released_wire_int8": "int8"}
PYCOMM_ZERO = ("pycomm_zero", "pycomm_zero_released", *ZERO_WIRES)
# fsdp2_pycomm on a group whose reduce-scatters cross hosts in a low-precision wire
# (pycomm.shm.Options.wire): for --hosts runs, with --impls.
FSDP2_WIRES = {"fsdp2_pycomm_wire_bf16": "bf16", "fsdp2_pycomm_wire_int8": "int8"}
SHARDED = (*PYCOMM_ZERO, "torch_zero", "torch_zero_fused", "fsdp2", "fsdp2_pycomm",
           *FSDP2_WIRES)
# The fast anchors of an AdamW run: each DDP (or torch's ZeRO) with torch's fused=True
# AdamW whatever --optimizer names, and pycomm's DDP with pycomm.optim.AdamW (torch's
# for-loop bits in one pass). Each maps to the implementation whose DDP it builds.
ANCHORS = {"pycomm_fused": "pycomm", "pycomm_onepass": "pycomm", "torch_fused": "torch",
           "torch_zero_fused": "torch_zero"}
ADAMW_IMPLS = ("pycomm_fused", "pycomm_onepass", "pycomm_zero", "pycomm_zero_released",
               "torch_fused", "torch_zero_fused", "fsdp2")


def fsdp2(module: nn.Module, bucket_cap_mb: float, backend: str = "",
          wire: str = "fp32") -> nn.Module:
    """torch's FSDP2 over the bench model: each block of its body (a Linear of the MLP, a
    layer of the transformer), then the root; on the default group, or on a new group of
    `backend` ("fsdp2_pycomm": the same ranks over pycomm's shared-memory backend, or its
    hierarchy across hosts, whose reduce-scatters cross in `wire`)."""
    del bucket_cap_mb  # FSDP2 communicates per fully_shard unit, not per bucket
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from .. import shm

    options = {"reshard_after_forward": False}
    if backend:
        pg_options = shm.Options(wire=wire) if backend == shm.BACKEND_NAME else None
        group = dist.new_group(backend=backend, pg_options=pg_options)
        options["mesh"] = DeviceMesh.from_group(group, next(module.parameters()).device.type)
    body = next(iter(module.children()))
    layers = getattr(body, "layers", body)  # TransformerEncoder's layers, or the Sequential
    blocks = [m for m in layers.children() if any(True for _ in m.parameters())]
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(module, **options)
    return module


def fsdp2_pycomm(module: nn.Module, bucket_cap_mb: float) -> nn.Module:
    return fsdp2(module, bucket_cap_mb, backend="pycomm")


def fsdp2_pycomm_wire(wire: str):
    """The maker of fsdp2_pycomm_wire_<wire>."""
    return lambda module, bucket_cap_mb: fsdp2(module, bucket_cap_mb, backend="pycomm",
                                               wire=wire)


def pycomm_zero(module: nn.Module, **kwargs: Any) -> PycommDDP:
    """The DDP of "pycomm_zero" (pycomm's own, default options); its optimizer is made by
    `optimizer`."""
    return PycommDDP(module, config=DDPConfig(**kwargs))


def pycomm_zero_wire(wire: str):
    """The DDP of a ZERO_WIRES implementation: pycomm_zero's with DDPConfig(wire=wire)."""
    return lambda module, **kwargs: pycomm_zero(module, wire=wire, **kwargs)


def optimizer(impl: str, model: nn.Module, name: str) -> torch.optim.Optimizer:
    cls, options = OPTIMIZERS[name]
    if impl in ANCHORS:  # configure() allows them with an AdamW only
        options = {**options, "fused": True} if impl != "pycomm_onepass" else options
        if impl == "pycomm_onepass":
            return pycomm_optim.AdamW(model.parameters(), **options)
        impl = ANCHORS[impl]
    if impl in PYCOMM_ZERO:
        return ZeroRedundancyOptimizer(model.parameters(), cls, overlap_with_ddp=True,
                                       release_gradients=impl != "pycomm_zero",
                                       **options)
    if impl == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        return TorchZero(model.parameters(), cls, **options)
    return cls(model.parameters(), **options)


def torch_zero(module: nn.Module, **kwargs: Any) -> TorchDDP:
    return TorchDDP(module, **kwargs)


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate without communicating: DDP's no_sync, FSDP2's gradient sync switch."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (tensors of any shape; DTensors' local
    shards)."""
    inner = getattr(opt, "optim", opt)  # the sharded optimizers wrap a local one
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def gather_hidden(opt: torch.optim.Optimizer, steps: int) -> float:
    """pycomm's sharded optimizer: the share of its parameter all-gathers' time the
    forward did not wait for, over the last `steps` steps; nan for the others."""
    if not isinstance(opt, ZeroRedundancyOptimizer):
        return float("nan")
    return opt.gather_report(steps)["hidden"]


def with_gathers(reports: list[StepReport], opt: torch.optim.Optimizer) -> list:
    """The steps to trace: with pycomm's sharded optimizer, its parameter all-gathers and
    the forward's waits for them drawn too."""
    if not isinstance(opt, ZeroRedundancyOptimizer):
        return reports
    return attach([r.timeline for r in reports], opt.gathers)
