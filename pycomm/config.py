"""The options of pycomm's DistributedDataParallel, in one dataclass.

Every option of torch's DDP that pycomm implements has a field here under the same name,
plus pycomm's own. `DistributedDataParallel(module, ..., config=DDPConfig(...))` takes
them; torch's keyword arguments build the same object. Defaults live here only.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch

DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's default bucket cap (MiB)."""

DEFAULT_FIRST_BUCKET_MB = 1.0
"""torch's first-bucket cap (MiB) when bucket_cap_mb is left at its default."""

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Chunk size of the construction-time broadcast of module states (torch's value)."""

PER_RANK = {"per_rank": True}
"""Field metadata of the options that may differ across ranks: they change how a rank
copies, records or schedules its own work, never which collectives the ranks run
together. Every other option must be the same on every rank (bucket caps excepted: rank
0's are adopted), which DistributedDataParallel checks at construction."""


@dataclass(frozen=True)
class DDPConfig:
    """pycomm's DistributedDataParallel options: torch's DDP arguments of the same names,
    plus pycomm's own. `DistributedDataParallel(module, config=DDPConfig(...))`."""

    bucket_cap_mb: Optional[float] = None
    """Bucket size cap in MiB (None: 25, with a 1 MiB first bucket, as torch does). An
    explicit value also caps the first bucket."""

    bucket_cap_mb_list: Optional[tuple[float, ...]] = None
    """Per-bucket caps in MiB in launch order (the last repeats); overrides bucket_cap_mb."""

    find_unused_parameters: bool = False
    """Traverse the autograd graph from the outputs each forward; parameters outside it
    contribute zeros and, when unused on every rank, keep their .grad untouched."""

    gradient_as_bucket_view: bool = dataclasses.field(default=False, metadata=PER_RANK)
    """param.grad IS a view into its bucket's flat buffer (no copy back after reduction)."""

    static_graph: bool = False
    """The set of used parameters never changes: learned in step 1, then no traversal."""

    broadcast_buffers: bool = True
    """Broadcast module buffers from rank 0 before a forward (torch's forward_sync_buffers,
    or its deprecated broadcast_buffers): before every forward that follows a synchronizing
    one (grad enabled, outside no_sync), as torch does. A forward under no_sync or
    torch.no_grad() leaves the next forward's buffers local."""

    init_sync: bool = True
    """Verify parameter shapes across ranks and broadcast rank 0's states at construction."""

    init_sync_buffers: bool = True
    """With init_sync: broadcast rank 0's buffers at construction too (parameters always
    are). torch turns it off when only broadcast_buffers=False is passed (each rank keeps
    its own BatchNorm statistics), and keeps it on with forward_sync_buffers=False."""

    record_timeline: bool = dataclasses.field(default=True, metadata=PER_RANK)
    """Record per-step timing (see Note [Timeline] in csrc/reducer/timeline.h): backward
    start, each parameter's ready time, each bucket's ready/launch/done, finalize."""

    timeline_steps: int = dataclasses.field(default=64, metadata=PER_RANK)
    """How many of the most recent steps the timeline ring keeps."""

    grad_reduce_dtype: Optional[torch.dtype] = None
    """Accumulate and reduce bf16/fp16 gradients in this dtype (e.g. torch.float32),
    Megatron's main_grad: their buckets are allocated in it and each such parameter gets
    `param.main_grad`, its wide view into the bucket. Every gradient autograd produces,
    inside no_sync or not, is added into main_grad in the wide dtype (fused accumulate) and
    param.grad is freed (None between micro-steps); the synchronized backward scales the
    sum by 1/world and reduces it in the wide dtype. After it, main_grad holds the averaged
    reduced gradient (valid until the next backward) and param.grad receives it cast to the
    parameter's dtype, unless main_grad_only. The sum restarts after each synchronized
    backward. Parameters already in a wider dtype are unaffected. See Note [main_grad
    accumulation] in csrc/reducer/main_grad.cpp."""

    skip_all_reduce_unused_params: bool = False
    """torch's option: a bucket whose parameters all went unused on this rank in a step is
    not reduced, and their grads stay untouched (needs find_unused_parameters or
    static_graph to know what is unused). Every rank must have the same unused set, as
    torch requires: otherwise the ranks launch different collectives."""

    batched_grad_copy: bool = dataclasses.field(default=False, metadata=PER_RANK)
    """torch's option: grads are copied into their bucket all at once when it is complete
    (one _foreach_copy_ per bucket) and the bucket divided once by the world size, instead
    of one scaled copy per parameter. Same numbers as torch in that mode (x / n)."""

    lazy_bucket_allocation: bool = dataclasses.field(default=False, metadata=PER_RANK)
    """torch 2.15's option: a bucket that goes through its buffer gets the buffer's memory
    when its first gradient is copied in and gives it back once backward is finalized, so
    between steps the DDP holds no copy of the gradients. Buckets reduced in place (the
    default over pycomm's shared-memory group) never take that memory, with or without it
    (See Note [Bucket memory] in csrc/reducer/bucket.cpp). Not for buckets whose views are
    param.grad (gradient_as_bucket_view) or param.main_grad (grad_reduce_dtype): those keep
    theirs. The DDP takes it as a keyword argument on torch >= 2.15, as torch's does."""

    shared_memory_gradients: bool = True
    """Reduce gradients through pycomm's shared-memory backend ("pycomm", see
    pycomm/shm.py) when the process group is a Gloo group whose ranks all run on this
    host: a "pycomm" group over the same ranks is made once (cached per group) and used
    for the gradient collectives only; the process group itself stays untouched for
    everything else. False keeps every gradient collective on the process group."""

    hierarchical_allreduce: bool = True
    """When the Gloo process group spans several hosts, each holding the same number of
    ranks (more than one): reduce gradients hierarchically through a "pycomm" group over
    the same ranks (reduce-scatter within each host over shared memory, all-reduce of each
    shard across hosts over Gloo, all-gather within the host: See Note [Hierarchical
    all-reduce] in csrc/shm/hier.h), which sends fewer bytes and steps over the slow
    links. Needs shared_memory_gradients. False keeps the flat Gloo all-reduce. One rank
    per host, or hosts with different numbers of ranks: flat Gloo either way."""

    wire: str = "fp32"
    """What a gradient all-reduce sends across hosts: "fp32" (the gradients as they are),
    "bf16" (half the bytes), or "int8" (a quarter, plus a float32 scale per 256
    elements). Every sum is formed in float32: each host's ranks are summed over shared
    memory in float32, and across hosts each rank owns a chunk of its piece, receives the
    other hosts' chunks in the wire format (an all-to-all), adds them in float32 and sends
    the sum back in the wire format (an all-gather), which every rank decodes alike, so all
    ranks end with the same bits. The gradient is thus rounded to the wire's precision
    twice, once going out and once coming back, however many ranks there are, where
    torch's bf16_compress_hook rounds every partial sum. Needs shared_memory_gradients and
    hierarchical_allreduce, CPU parameters and float32, bfloat16 or float16 gradients; with
    one rank per host the hierarchy has one rank per host. On a group whose ranks all share
    a host nothing crosses a host, and the gradients stay as they are (a warning says so).
    Not with a comm hook (which decides what it sends itself). Under pycomm's
    ZeroRedundancyOptimizer(release_gradients=True) each bucket's reduce-scatter carries
    the wire instead of the all-reduce: each host's sums of a rank's range cross once,
    encoded, and the rank adds them in float32, so its gradients are rounded once (the
    bucket's tail, fewer elements than ranks, crosses in float32); with the gradients kept
    (the default) the sharded optimizer steps on what the all-reduce delivered. See Note
    [Low-precision wire] in csrc/shm/wire_codec.h. The config holds it parsed, with
    wire_error_feedback, as one pycomm.Wire (config.wire_format); ddp.reducer.wire says
    what is in effect (a pycomm.Wire, equal to its name; None once a comm hook, the sharded
    optimizer's included, replaced the all-reduce). Where the wire is in effect (a group
    spanning hosts), a float64 gradient (a float64 parameter, or a bf16/fp16 one under
    grad_reduce_dtype=torch.float64) is refused when the DDP is built, naming the
    parameter (Wire::check_carries in csrc/comm/wire.cpp)."""

    wire_error_feedback: bool = False
    """With wire="int8": what the int8 encoding loses is kept per rank and added to the
    next step's gradient before it is encoded (for the rank's share it sends and for the
    sums it sends back), so that over steps the losses cancel rather than add up. One
    float32 copy of the rank's share of each bucket, restarted when buckets are rebuilt."""

    inline_collectives: bool = dataclasses.field(default=False, metadata=PER_RANK)
    """Run each bucket's default all-reduce on the backward thread as the bucket completes,
    instead of on a communication thread (see Note [Inline collectives] in
    csrc/reducer/launch.cpp); comm hooks stay asynchronous. Meant for gradients over the
    shared-memory backend on a host whose cores the ranks' compute threads already fill
    (there a communication thread can only run by taking a core from backward). Off by
    default: each bucket then also waits for the slowest rank to reach it, which costs
    more than it saves on compute-heavy steps and on a machine shared with other work
    (see benchmarks/results/ddp_inline_collectives_2ranks_cpu.md)."""
    streaming_copies: bool = dataclasses.field(default=True, metadata=PER_RANK)
    """Where a bucket is not reduced in place (in_place_reduction): copy gradients of 256 KiB
    and more into their bucket (and the reduced values back into param.grad) with
    non-temporal stores, which neither read the destination first nor keep it in cache:
    about 40% less CPU per copied byte here, bitwise the same values (See Note [Streaming
    copies] in csrc/reducer/stream_copy.cpp). False copies with ATen, which can pay on a
    CPU whose cache holds a whole bucket until its collective reads it."""
    in_place_reduction: bool = dataclasses.field(default=True, metadata=PER_RANK)
    """Over pycomm's shared-memory group, and its hierarchical group across hosts on any
    wire, all-reduce each bucket's gradients where they are
    (read from param.grad, scaled by 1/world as they are read, the sums written back)
    instead of copying them into the bucket and the result back out: two passes over the
    gradients' memory fewer per step, the same bits in param.grad (See Note [Gradients
    reduced in place] in csrc/reducer/in_place.cpp, which lists what keeps a bucket on its
    buffer). DistributedDataParallel.clip_grad_norm_ then sums its norm per gradient rather
    than per bucket buffer, which can move the norm's last bit. False always reduces
    through the bucket, as torch's DDP does."""
    main_grad_only: bool = dataclasses.field(default=False, metadata=PER_RANK)
    """With grad_reduce_dtype: the reduced gradient of a bf16/fp16 parameter is left in
    param.main_grad (wide dtype) only and param.grad stays None, for an optimizer keeping
    fp32 master weights that reads main_grad (no rounding to the parameter's dtype, no
    second copy). False: param.grad also gets it in the parameter's dtype (drop-in)."""

    local_clip_max_norm: Optional[float] = None
    """Clip each rank's local gradients to this total norm BEFORE the all-reduce (Horovod's
    other order; ddp.clip_grad_norm_ clips after it). The reducer then launches no bucket
    while backward runs: at its end one fused pass takes the local norm over all buckets,
    one pass scales them by the clip coefficient (1/world folded in), and every bucket is
    launched in order. This gives up all overlap of communication with backward. See
    Note [Clip after vs before the all-reduce] in pycomm/ddp/clip.py; ddp.local_grad_norm()
    returns the local norm of the last synchronized backward."""

    local_clip_norm_type: float = 2.0
    """The norm order of local_clip_max_norm (as torch's clip_grad_norm_: > 0 or inf)."""

    local_clip_error_if_nonfinite: bool = False
    """torch's clip_grad_norm_ error_if_nonfinite for local_clip_max_norm: when a rank's
    local norm is inf or nan, backward raises a RuntimeError on EVERY rank in that step (the
    bad rank names itself and its norm, the others name the bad ranks), before anything is
    scaled or reduced: each rank's param.grad is left as its local, unclipped gradient, as
    torch leaves it when it raises. The ranks agree through one extra all-reduce of a flag
    per rank and a host sync in every synchronized backward, so no rank waits for another;
    a rank that died instead makes the others fail within the group timeout. See Note
    [Non-finite local norm] in csrc/reducer/local_clip.cpp."""

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

        if self.main_grad_only and self.grad_reduce_dtype is None:
            raise ValueError("main_grad_only needs grad_reduce_dtype (e.g. torch.float32)")
        if self.local_clip_max_norm is not None and not self.local_clip_max_norm > 0:
            raise ValueError(f"local_clip_max_norm must be positive, got "
                             f"{self.local_clip_max_norm}")
        if self.local_clip_error_if_nonfinite and self.local_clip_max_norm is None:
            raise ValueError("local_clip_error_if_nonfinite needs local_clip_max_norm")
        from . import _C  # the wire's rules have one owner, csrc/comm/wire.cpp

        # See Note [The wire as a value] in csrc/comm/wire.h: parsed here, once, and read
        # as this value from here on (the reducer's options, the sharded optimizer's hook)
        object.__setattr__(self, "wire_format", _C.Wire(self.wire, self.wire_error_feedback))
        if not self.wire_format.exact and not (self.shared_memory_gradients
                                        and self.hierarchical_allreduce):
            raise ValueError(f"wire={self.wire!r} crosses hosts through the hierarchical "
                             f"all-reduce: it needs shared_memory_gradients=True and "
                             f"hierarchical_allreduce=True")
        if not self.local_clip_norm_type > 0:
            raise ValueError(f"local_clip_norm_type must be > 0 or inf, got "
                             f"{self.local_clip_norm_type}")

    def __setstate__(self, state: dict) -> None:
        """Unpickling (no __post_init__): a config pickled before wire_format existed gets
        it parsed from its fields (pycomm/ddp/pickling.py: older pickles load)."""
        self.__dict__.update(state)
        if "wire_format" not in state:
            from . import _C

            object.__setattr__(self, "wire_format",
                               _C.Wire(self.wire, self.wire_error_feedback))

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


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal under it), read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _document_fields(cls: type) -> None:
    """Append every field, its default and its docstring to the class docstring, so that
    help(DDPConfig) shows them (Python keeps attribute docstrings only in the source)."""
    docs = _field_docs(cls)
    lines = [inspect.cleandoc(cls.__doc__ or ""), "", "Fields:"]
    for field in dataclasses.fields(cls):
        lines.append(f"  {field.name} = {field.default!r}")
        lines += ["      " + line for line in docs.get(field.name, "").splitlines()]
    cls.__doc__ = "\n".join(lines)


# Without the source (a frozen or stripped install) help() shows the summary only.
with contextlib.suppress(OSError):
    _document_fields(DDPConfig)
