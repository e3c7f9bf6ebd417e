"""The options of pycomm's DistributedDataParallel, in one dataclass.

Every option of torch's DDP that pycomm implements has a field here under the same name,
plus pycomm's own. `DistributedDataParallel(module, ..., config=DDPConfig(...))` takes
them; torch's keyword arguments build the same object. Defaults live here only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's default bucket cap (MiB)."""

DEFAULT_FIRST_BUCKET_MB = 1.0
"""torch's first-bucket cap (MiB) when bucket_cap_mb is left at its default."""

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Chunk size of the construction-time broadcast of module states (torch's value)."""


@dataclass(frozen=True)
class DDPConfig:
    bucket_cap_mb: Optional[float] = None
    """Bucket size cap in MiB (None: 25, with a 1 MiB first bucket, as torch does). An
    explicit value also caps the first bucket."""

    bucket_cap_mb_list: Optional[tuple[float, ...]] = None
    """Per-bucket caps in MiB in launch order (the last repeats); overrides bucket_cap_mb."""

    find_unused_parameters: bool = False
    """Traverse the autograd graph from the outputs each forward; parameters outside it
    contribute zeros and, when unused on every rank, keep their .grad untouched."""

    gradient_as_bucket_view: bool = False
    """param.grad IS a view into its bucket's flat buffer (no copy back after reduction)."""

    static_graph: bool = False
    """The set of used parameters never changes: learned in step 1, then no traversal."""

    broadcast_buffers: bool = True
    """Broadcast module buffers from rank 0 before each forward (torch's
    broadcast_buffers / forward_sync_buffers)."""

    init_sync: bool = True
    """Verify parameter shapes across ranks and broadcast rank 0's states at construction."""

    record_timeline: bool = True
    """Record per-step timing (see Note [Timeline] in csrc/reducer/timeline.h): backward
    start, each parameter's ready time, each bucket's ready/launch/done, finalize."""

    timeline_steps: int = 64
    """How many of the most recent steps the timeline ring keeps."""

    grad_reduce_dtype: Optional[torch.dtype] = None
    """Reduce bf16/fp16 gradients in this dtype (e.g. torch.float32): their buckets are
    allocated in it, grads are widened while copied in (then scaled by 1/world in the wide
    type), summed in it, and cast back into param.grad at finalize. Each such parameter
    also gets `param.main_grad`, Megatron-style: its fp32 view into the bucket, holding the
    averaged, reduced gradient after backward (valid until the next backward). Parameters
    already in a wider dtype are unaffected. With it, gradient_as_bucket_view cannot make
    param.grad a bucket view for those parameters (dtypes differ); they are copied."""

    skip_all_reduce_unused_params: bool = False
    """torch's option: a bucket whose parameters all went unused on this rank in a step is
    not reduced, and their grads stay untouched (needs find_unused_parameters or
    static_graph to know what is unused). Every rank must have the same unused set, as
    torch requires: otherwise the ranks launch different collectives."""

    batched_grad_copy: bool = False
    """torch's option: grads are copied into their bucket all at once when it is complete
    (one _foreach_copy_ per bucket) and the bucket divided once by the world size, instead
    of one scaled copy per parameter. Same numbers as torch in that mode (x / n)."""

    shared_memory_gradients: bool = True
    """Reduce gradients through pycomm's shared-memory backend ("pycomm", see
    pycomm/shm.py) when the process group is a Gloo group whose ranks all run on this
    host: a "pycomm" group over the same ranks is made once (cached per group) and used
    for the gradient collectives only; the process group itself stays untouched for
    everything else. False keeps every gradient collective on the process group."""

    inline_collectives: bool = False
    """Run each bucket's default all-reduce on the backward thread as the bucket completes,
    instead of on a communication thread (see Note [Inline collectives] in
    csrc/reducer/reducer.cpp); comm hooks stay asynchronous. Meant for gradients over the
    shared-memory backend on a host whose cores the ranks' compute threads already fill
    (there a communication thread can only run by taking a core from backward). Off by
    default: each bucket then also waits for the slowest rank to reach it, which costs
    more than it saves on compute-heavy steps and on a machine shared with other work
    (see benchmarks/results/ddp_v2_2ranks_cpu.md)."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if self.bucket_cap_mb_list is not None and (
                not self.bucket_cap_mb_list or min(self.bucket_cap_mb_list) <= 0):
            raise ValueError(f"bucket_cap_mb_list must be non-empty and positive, got "
                             f"{self.bucket_cap_mb_list}")
        if self.timeline_steps < 0:
            raise ValueError(f"timeline_steps must be >= 0, got {self.timeline_steps}")
        if self.grad_reduce_dtype is not None and not self.grad_reduce_dtype.is_floating_point:
            raise ValueError(f"grad_reduce_dtype must be a floating dtype, got "
                             f"{self.grad_reduce_dtype}")

    def bucket_byte_limits(self) -> list[int]:
        """Byte caps per bucket in launch order (the last repeats)."""
        mib = 1024 * 1024
        if self.bucket_cap_mb_list is not None:
            return [int(c * mib) for c in self.bucket_cap_mb_list]
        if self.bucket_cap_mb is None:
            return [int(DEFAULT_FIRST_BUCKET_MB * mib), int(DEFAULT_BUCKET_CAP_MB * mib)]
        return [int(self.bucket_cap_mb * mib)]

    def replace(self, **changes) -> DDPConfig:
        return dataclasses.replace(self, **changes)
