"""Constructor-argument wiring of pycomm's DistributedDataParallel (module.py): which
torch arguments are refused, how torch's keyword arguments and a DDPConfig combine, which
process group gradients run on, and the output traversal that finds the tensors backward
starts from. Pure functions of their arguments; the module itself stays in module.py."""

from __future__ import annotations

import inspect
import itertools
import warnings
from dataclasses import fields, is_dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config import DDPConfig
from ..shm import hierarchical_group, hierarchy, host_layout, same_host_group
from .compat import TORCH_DDP

_UNIMPLEMENTED = {  # torch argument -> (its value that pycomm implements, why not others)
    "mixed_precision": (None, "torch 2.13's _MixedPrecision needs accelerator streams and "
                        "events (torch's own DDP fails on CPU: 'cpu backend doesn't support "
                        "events'), so pycomm has no oracle for it here; for fp32 reduction of "
                        "bf16/fp16 gradients use DDPConfig(grad_reduce_dtype=torch.float32)"),
}


NOT_GIVEN: Any = object()
"""The default of a constructor argument that only some torch releases' DDP takes."""

_TORCH_DDP_ARGS = inspect.signature(TORCH_DDP.__init__).parameters
_RELEASE_ARGS = ("lazy_bucket_allocation",)  # torch 2.15's


def release_argument(name: str, value: Any, default: Any) -> Any:
    """`value` of a constructor argument of a later torch's DDP (_RELEASE_ARGS), or
    `default` when not given; on a torch whose DDP lacks it, the TypeError torch's gives."""
    if value is NOT_GIVEN:
        return default
    if name not in _TORCH_DDP_ARGS:
        raise TypeError(f"DistributedDataParallel.__init__() got an unexpected keyword argument "
                        f"'{name}' (torch {torch.__version__}'s DDP has no such argument; it "
                        f"came in a later torch)")
    return value


def torch_release_signature(init: Any) -> inspect.Signature:
    """`init`'s signature as the installed torch's DDP has it: without the arguments of a
    later release (_RELEASE_ARGS) where torch's lacks them, with their torch default where
    it has them."""
    sig = inspect.signature(init)
    params = [p.replace(default=_TORCH_DDP_ARGS[p.name].default) if p.name in _RELEASE_ARGS
              and p.name in _TORCH_DDP_ARGS else p
              for p in sig.parameters.values()
              if p.name not in _RELEASE_ARGS or p.name in _TORCH_DDP_ARGS]
    return sig.replace(parameters=params)


def gradient_group(process_group: dist.ProcessGroup, config: DDPConfig,
                   device: torch.device) -> dist.ProcessGroup:
    """The group gradient collectives run on: the one place that choice is made. For
    parameters in host memory (`device`), a Gloo group whose ranks share this host gets a
    shared-memory "pycomm" group over the same ranks (config.shared_memory_gradients); one
    spanning hosts with several ranks on each a hierarchical "pycomm" group
    (config.hierarchical_allreduce); anything else, CUDA parameters on a Gloo group
    included (the shared-memory backend reduces host memory only), keeps `process_group`."""
    wire = not config.wire_format.exact
    if wire and device.type != "cpu":
        raise ValueError(f"DDPConfig(wire={config.wire!r}) sends CPU gradients across hosts "
                         f"through pycomm's hierarchical all-reduce; these parameters are on "
                         f"{device} (use wire='fp32', or torch's bf16_compress_hook)")
    if not config.shared_memory_gradients or device.type != "cpu":
        return process_group
    group = same_host_group(process_group)
    if group is None and config.hierarchical_allreduce:
        group = hierarchical_group(process_group, one_rank_per_host=wire)
    if (wire and group is None and dist.get_world_size(process_group) > 1
            and len(host_layout(process_group).hosts) > 1):
        layout = host_layout(process_group).describe()
        raise ValueError(f"DDPConfig(wire={config.wire!r}) needs a CPU Gloo group whose hosts "
                         f"each hold the same number of ranks ({layout}), for the "
                         f"hierarchical all-reduce that carries it")
    if wire and (group is None or hierarchy(group) is None):
        warnings.warn(f"DDPConfig(wire={config.wire!r}): every rank of the group runs on "
                      f"this host, so no gradient crosses a host and none is sent as "
                      f"{config.wire} (ddp.reducer.wire is fp32)", UserWarning, stacklevel=4)
    return group or process_group


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside an output made of tensors, tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return list(itertools.chain.from_iterable(map(find_tensors, obj)))
    if isinstance(obj, dict):
        return list(itertools.chain.from_iterable(map(find_tensors, obj.values())))
    if is_dataclass(obj) and not isinstance(obj, type):
        return list(itertools.chain.from_iterable(
            find_tensors(getattr(obj, f.name)) for f in fields(obj)))
    return []


def resolve_group(process_group, device_mesh) -> dist.ProcessGroup:
    if device_mesh is not None:
        if process_group is not None:
            raise RuntimeError("pass either process_group or device_mesh, not both")
        if device_mesh.ndim != 1:
            # torch 2.13 refuses these too (RuntimeError "Only 1D device mesh is supported");
            # a 1-D slice of a larger mesh (mesh["dp"]) is what both accept.
            raise NotImplementedError(f"device_mesh: only a 1-D mesh (or a 1-D slice such as "
                                      f"mesh['dp'] of a larger one) is supported, as in "
                                      f"torch, got a {device_mesh.ndim}-D mesh")
        return device_mesh.get_group(mesh_dim=0)
    group = (process_group if process_group is not None
             else dist.distributed_c10d._get_default_group())
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(group).__name__}")
    return group


def check_args(*, mixed_precision: Any, delay_all_reduce_named_params: Any,
               param_to_hook_all_reduce: Any, check_reduction: bool) -> None:
    """Refuse torch's arguments pycomm does not implement, and their inconsistent pairs."""
    given = {"mixed_precision": mixed_precision}
    for name, (supported, why) in _UNIMPLEMENTED.items():
        if given[name] is not supported and given[name] != supported:
            raise NotImplementedError(f"pycomm DistributedDataParallel does not implement "
                                      f"{name}={given[name]!r}: {why}")
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to "
                         "be set at the same time.")
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                      "deprecated. Please avoid using it.", FutureWarning, stacklevel=3)


def buffer_sync(broadcast_buffers: Optional[bool],
                forward_sync_buffers: Optional[bool]) -> tuple[bool, bool]:
    """(sync buffers before forwards, sync them at construction), as torch 2.13 derives
    them: forward_sync_buffers wins and leaves the construction-time sync on; the
    deprecated broadcast_buffers alone governs both."""
    if broadcast_buffers is not None:
        which = ("is ignored because forward_sync_buffers was given"
                 if forward_sync_buffers is not None else
                 "also turns off the construction-time buffer sync, which "
                 "forward_sync_buffers=False does not")
        warnings.warn(f"DistributedDataParallel(broadcast_buffers=...) is deprecated in torch "
                      f"2.13 (use forward_sync_buffers); its value {which}",
                      FutureWarning, stacklevel=4)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    sync = True if broadcast_buffers is None else broadcast_buffers
    return sync, sync


def config_from_args(config: Optional[DDPConfig], *, bucket_cap_mb: Optional[float],
                     bucket_cap_mb_list: Any, find_unused_parameters: bool,
                     gradient_as_bucket_view: bool, static_graph: bool,
                     broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool],
                     init_sync: bool, skip_all_reduce_unused_params: bool,
                     batched_grad_copy: bool, lazy_bucket_allocation: bool) -> DDPConfig:
    """The DDPConfig of torch's keyword arguments, or `config` when they are all left at
    their defaults (both at once is refused, naming the arguments given twice)."""
    sync, init_buffers = buffer_sync(broadcast_buffers, forward_sync_buffers)
    from_args = dict(
        bucket_cap_mb=bucket_cap_mb,
        bucket_cap_mb_list=None if bucket_cap_mb_list is None else tuple(bucket_cap_mb_list),
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
        broadcast_buffers=sync, init_sync=init_sync, init_sync_buffers=init_buffers,
        skip_all_reduce_unused_params=skip_all_reduce_unused_params,
        batched_grad_copy=batched_grad_copy, lazy_bucket_allocation=lazy_bucket_allocation)
    if config is None:
        return DDPConfig(**from_args)
    default = DDPConfig()
    clash = [k for k, v in from_args.items() if v != getattr(default, k)]
    if clash:
        raise ValueError(f"pass {', '.join(clash)} either as arguments or in config, not both")
    return config
