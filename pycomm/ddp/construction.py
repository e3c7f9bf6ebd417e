"""Construction of pycomm's DistributedDataParallel: which parameters and buffers it
reduces, keeps identical across ranks or leaves alone, the device checks, the
construction-time check and broadcast of the ranks' states, and the reducer with its first
bucket layout. Pure functions of what they are given; torch's keyword arguments are
args.py's, the module that calls these is module.py."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..config import BROADCAST_BUCKET_BYTES, DDPConfig
from ..objects import all_gather_object
from ..shm import ranks_by_host
from .compat import TorchReducer

NamedParams = list[tuple[str, nn.Parameter]]


def ignored(module: nn.Module, delayed_names: set[str]) -> set[str]:
    """Names the reducer and the state broadcasts leave alone: the module's ignored ones and
    the delayed ones (see delay.py), as torch's parameters_to_ignore."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | delayed_names


def trainable_params(module: nn.Module, delayed_names: set[str]) -> NamedParams:
    """The parameters whose gradients the reducer all-reduces."""
    skip = ignored(module, delayed_names)
    named = [(n, p) for n, p in module.named_parameters()
             if p.requires_grad and n not in skip]
    if not named and delayed_names:
        raise NotImplementedError("delay_all_reduce_named_params covering every trainable "
                                  "parameter (torch then runs without a reducer) is not "
                                  "implemented by pycomm")
    if not named:
        raise RuntimeError("DistributedDataParallel is not needed when a module doesn't "
                           "have any parameter that requires a gradient.")
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise NotImplementedError(f"sparse gradients ({name or 'module'} has "
                                      "sparse=True) are not supported by pycomm DDP")
    return named


def params_to_sync(module: nn.Module, delayed_names: set[str]) -> NamedParams:
    """Parameters (trainable or not) kept identical across ranks: all but the ignored."""
    skip = ignored(module, delayed_names)
    return [(n, p) for n, p in module.named_parameters() if n not in skip]


def buffers_to_sync(module: nn.Module, delayed_names: set[str]) -> list[torch.Tensor]:
    skip = ignored(module, delayed_names)
    return [b.detach() for n, b in module.named_buffers() if n not in skip]


class Placement(NamedTuple):
    """Where the module lives, in torch's terms."""
    device: torch.device
    device_ids: Optional[list[int]]
    output_device: object


def placement(module: nn.Module, named_params: NamedParams, device_ids, output_device,
              group: dist.ProcessGroup) -> Placement:
    """The module's device, checked against torch's rules for device_ids and the backend."""
    devices = {p.device for _, p in named_params}
    if len(devices) > 1 and device_ids is not None:
        raise ValueError(f"DistributedDataParallel device_ids and output_device arguments "
                         f"only work with single-device modules, but parameters are on "
                         f"{sorted(map(str, devices))}; pass device_ids=None")
    device = next(iter(devices))
    if device.type == "cuda" and not _C.cuda:
        raise RuntimeError(f"pycomm's extension was built without its CUDA kernels (no GPU "
                           f"was visible when it was built), and these parameters are on "
                           f"{device}: rebuild it with PYCOMM_CUDA=1 (or TORCH_CUDA_ARCH_LIST "
                           f"set), e.g. PYCOMM_CUDA=1 pip install --no-build-isolation -e .")
    if device.type == "cpu" and device_ids is not None:
        raise ValueError(f"device_ids must be None for a CPU module, got {device_ids}")
    for name, sub in module.named_modules():
        if isinstance(sub, nn.SyncBatchNorm) and device.type == "cpu":
            raise ValueError(f"SyncBatchNorm layers only work with GPU modules ({name})")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        raise ValueError(f"process group backend 'nccl' cannot reduce gradients of "
                         f"parameters on {device}; use a gloo group for CPU modules")
    ids = None if device_ids is None else [
        d.index if isinstance(d, torch.device) else int(d) for d in device_ids]
    output = output_device if output_device is not None else (ids[0] if ids else None)
    return Placement(device, ids, output)


_CAPS = ("bucket_cap_mb", "bucket_cap_mb_list")


def agreed_config(config: DDPConfig, group: dist.ProcessGroup) -> DDPConfig:
    """`config` as every rank agrees it, before any other collective of the construction.
    The bucket caps: torch's DDP adopts rank 0's bucket layout, so ranks given different
    bucket_cap_mb / bucket_cap_mb_list train there; here every rank takes rank 0's caps,
    and warns once, naming each rank's caps, when they differ. Any other option that
    differs, except the per-rank ones (config.PER_RANK), would make the ranks run different
    collectives: a ValueError on every rank names each such option and every rank's value.
    Collective over `group`."""
    mine = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if not f.metadata.get("per_rank")}
    everyone = all_gather_object(mine, group=group)
    differ = [name for name in mine if name not in _CAPS
              and any(other[name] != everyone[0][name] for other in everyone)]
    if differ:
        shown = "; ".join(f"{name} (" + ", ".join(
            f"rank {r}: {other[name]!r}" for r, other in enumerate(everyone)) + ")"
            for name in differ)
        raise ValueError(f"DistributedDataParallel: the ranks' options differ: {shown}. Pass "
                         f"the same options on every rank: these decide which collectives "
                         f"the ranks run together")
    everyone = [tuple(other[name] for name in _CAPS) for other in everyone]
    if all(caps == everyone[0] for caps in everyone):
        return config
    shown = "; ".join(f"rank {r}: {_caps_text(c)}" for r, c in enumerate(everyone))
    warnings.warn(f"DistributedDataParallel: the ranks' bucket caps differ ({shown}); every "
                  f"rank uses rank 0's, as torch's DDP adopts rank 0's bucket layout",
                  stacklevel=3)
    return config.replace(bucket_cap_mb=everyone[0][0], bucket_cap_mb_list=everyone[0][1])


def _caps_text(caps: tuple) -> str:
    cap, caps_list = caps
    parts = ([] if cap is None else [f"bucket_cap_mb={cap:g}"]) + (
        [] if caps_list is None else [f"bucket_cap_mb_list={[float(c) for c in caps_list]}"])
    return ", ".join(parts) or "torch's defaults"


def verify_and_sync_states(group: dist.ProcessGroup, params: NamedParams,
                           buffers: list[torch.Tensor]) -> None:
    """Check every rank holds the same parameters (name, shape, dtype), then broadcast rank
    0's parameters and `buffers`."""
    meta = [(n, tuple(p.shape), str(p.dtype)) for n, p in params]
    gathered = all_gather_object(meta, group=group)
    for rank, other in enumerate(gathered):
        if other == gathered[0]:
            continue
        for a, b in itertools.zip_longest(gathered[0], other):
            if a is None or b is None:  # one rank has more: name the first extra one
                raise RuntimeError(
                    f"DDP expects the same parameters on every rank: rank 0 has "
                    f"{len(gathered[0])} parameters to reduce, rank {rank} has {len(other)}; "
                    f"the first beyond the shorter list: {a if b is None else b} on rank "
                    f"{0 if b is None else rank} (name, shape, dtype)")
            if a != b:
                raise RuntimeError(f"DDP expects the same parameters on every rank: rank 0 "
                                   f"has {a}, rank {rank} has {b} (name, shape, dtype)")
    states = [p.detach() for _, p in params] + buffers
    if states:
        dist._broadcast_coalesced(group, states, BROADCAST_BUCKET_BYTES, 0)


def build_reducer(named_params: NamedParams, gradient_pg: dist.ProcessGroup,
                  group: dist.ProcessGroup, config: DDPConfig) -> TorchReducer:
    """The C++ reducer over `named_params`, all-reducing on `gradient_pg`."""
    params = [p for _, p in named_params]
    names = [n for n, _ in named_params]
    # Before any gradient was seen: buckets cut in reverse registration order (so overlap
    # starts at step 1, unlike torch 2.13's single first-step bucket), each laid out in
    # registration order as torch lays out its buckets (so a one-bucket layout is
    # byte-identical to torch's and reductions match bitwise).
    order = list(reversed(range(len(params))))
    assignment = [sorted(b) for b in
                  _C.assign_buckets(params, order, config.bucket_byte_limits())]
    # the C++ reads its options from the config by name (Note [Reducer options])
    reducer = TorchReducer(params, names, assignment, gradient_pg, config)
    # Whose address a Gloo error names, where the group spans hosts (the flat group or the
    # hierarchical one's Gloo parts; [] on one host).
    reducer.set_peer_hosts(ranks_by_host(group))
    return reducer
