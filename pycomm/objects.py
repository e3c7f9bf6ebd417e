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
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

# Note [Buffers outlive the Work]
# A Gloo collective's Work holds its tensors, and Gloo's worker thread drops its reference
# to the Work a moment after the caller's wait returned. If that is the last reference,
# the worker destroys the Work and releases the tensors' Python objects, which takes the
# GIL; a rank that is exiting meanwhile (a trace gathered as a job's last act) has its
# interpreter finalizing, the worker is told to exit inside a noexcept destructor, and
# the process aborts after its work was done: "terminate called without an active
# exception", SIGABRT (1 run in 6-20 of tests/hosts/test_ddp.py's trace test; the core:
# ProcessGroupGloo::runLoop -> ~AsyncGatherWork -> TensorImpl::decref_pyobject ->
# gil_scoped_acquire -> pthread_exit). Holding the tensors alone is not enough: releasing
# a tensor whose Python object is alive takes the GIL too. So the exchanges here run
# async_op=True, wait, and keep the Work (and its tensors) referenced from Python until
# the next exchange: Gloo's release is then never the last, and the Work dies on a Python
# thread.
_LAST: list[Any] = []


def _run(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`collective(*args, **kwargs)` to completion, its Work and arguments kept until the
    next call (See Note [Buffers outlive the Work])."""
    work = collective(*args, async_op=True, **kwargs)
    work.wait()
    _LAST[:] = [work, args]


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
    _run(dist.all_gather, sizes, mine, group=group)
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
    padded = _padded(payload, longest)
    _run(dist.all_gather, received, padded, group=group)
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
    padded = _padded(payload, longest)
    _run(dist.gather, padded, received, dst=dst, group=group)
    return [_decode(t, n) for t, n in zip(received, sizes)] if is_dst else None
