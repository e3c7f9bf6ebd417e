"""Picklable-object collectives (all_gather, gather) carried in uint8 tensors.

torch's `dist.all_gather_object` / `gather_object` turn the received bytes back into
objects through `tensor.numpy()`, and torch's CPU wheel does not depend on numpy: on a
fresh install they raise "Numpy is not available". pycomm does not need numpy, so it
moves objects with its own two functions: pickle into a uint8 tensor, exchange sizes,
exchange the padded payloads, read the bytes back with `ctypes` (no numpy, no per-byte
Python loop). Used for pycomm's small cross-rank metadata (parameter shapes at DDP
construction, host identities, trace timelines); not a data path.

As with torch's object collectives, unpickling runs code chosen by the peer: only use them
between ranks of one job.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist


def _device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the payload must live for the group's backend: NCCL moves CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj))  # writable: frombuffer shares it without a warning
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _decode(payload: torch.Tensor, size: int) -> Any:
    data = payload[:size].cpu().contiguous()
    return pickle.loads(ctypes.string_at(data.data_ptr(), size))


def _exchange_sizes(payload: torch.Tensor, group) -> list[int]:
    world = dist.get_world_size(group)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=group)
    return [int(s.item()) for s in sizes]


def _padded(payload: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.uint8, device=payload.device)
    out[:payload.numel()] = payload
    return out


def all_gather_object(obj: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's `obj`, in group-rank order, on every rank of `group`."""
    payload = _encode(obj, _device(group))
    sizes = _exchange_sizes(payload, group)
    longest = max(sizes)
    received = [torch.empty(longest, dtype=torch.uint8, device=payload.device) for _ in sizes]
    dist.all_gather(received, _padded(payload, longest), group=group)
    return [_decode(t, n) for t, n in zip(received, sizes)]


def gather_object(obj: Any, dst_group_rank: int = 0,
                  group: Optional[dist.ProcessGroup] = None) -> Optional[list[Any]]:
    """Every rank's `obj`, in group-rank order, on group rank `dst_group_rank`; None on the
    other ranks. Every rank of `group` must call it."""
    payload = _encode(obj, _device(group))
    sizes = _exchange_sizes(payload, group)
    longest = max(sizes)
    is_dst = dist.get_rank(group) == dst_group_rank
    received = ([torch.empty(longest, dtype=torch.uint8, device=payload.device) for _ in sizes]
                if is_dst else None)
    dst = dist.get_global_rank(group, dst_group_rank) if group is not None else dst_group_rank
    dist.gather(_padded(payload, longest), received, dst=dst, group=group)
    return [_decode(t, n) for t, n in zip(received, sizes)] if is_dst else None
