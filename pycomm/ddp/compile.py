"""What torch.compile needs from pycomm's DistributedDataParallel: the call of the wrapped
module that dynamo compiles, the graph split at pycomm's buckets around it, and the
fallback when a torch refuses to split. pycomm's own per-forward work (the C++ reducer,
buffer broadcasts, join) never enters a graph: module.py keeps it out with
torch._disable_dynamo. Compiled autograd is refused by the reducer's hooks (See Note
[Compiled autograd] in csrc/reducer/reducer.cpp).

Note [Graph split at pycomm's buckets]
A compiled region's backward is one autograd node: all its gradients land when it ends,
and with them every bucket. torch's dynamo cuts the forward graph it captures into pieces
of about a bucket (its DDPOptimizer, torch/_dynamo/backends/distributed.py) when, as it
compiles a frame, torch's `DistributedDataParallel._get_active_ddp_module()` names a
module; each piece is compiled on its own, so each piece's backward is a node that
delivers its gradients as it finishes, and buckets launch while the pieces before them in
the forward still run their backward, as in eager mode. torch's DDP names itself there
around its module's call; pycomm's forward names a SplitHint of itself, and calls the
module through `_call_module`, the frame dynamo compiles (so a module whose forward is
torch's own, such as nn.Sequential, is compiled too: through torch's DDP it is not).

    eager:     backward [l8][l7][l6][l5][l4][l3][l2][l1]      a bucket per two layers
               comm          [b0  ][b1  ][b2  ][b3  ]
    compiled:  backward [l8 ... l1 in one node ........]
               comm                                    [b0][b1][b2][b3]   all exposed
    split:     backward [piece 0][piece 1][piece 2][piece 3]
               comm              [b0     ][b1     ][b2     ][b3 ]

How dynamo's pieces relate to pycomm's buckets:
  - dynamo walks the graph backwards, from the output, and ends a piece at the first node
    where it holds at least its cap: 1 MiB for the first piece (torch's first bucket),
    then `bucket_bytes_cap`. SplitHint's cap is that of pycomm's steady buckets (the last
    of DDPConfig.bucket_byte_limits()), at least 1 MiB (dynamo refuses a smaller one). So
    with default caps (1 MiB first, then 25 MiB) pieces and step-1 buckets follow one rule
    over nearly one order (reverse graph order for pieces, reverse registration order for
    buckets); with bucket_cap_mb=X the first piece is smaller than the first bucket.
  - after step 1 pycomm re-cuts its buckets in the gradient-ready order it observed and
    ends them only where a piece's burst of gradients ends (See Note [Gradient groups] in
    csrc/reducer/rebuild.cpp): each bucket is then whole pieces, or a share of one piece
    at least twice its cap, and launches as the last of its pieces finishes backward.

Note [Refused split]
torch 2.13's dynamo splits graphs holding higher-order ops (torch.utils.checkpoint,
torch.cond, flex_attention); torch 2.4 and 2.5 refuse to ("DDPOptimizer backend: Found a
higher order op in the graph", torch issue 104674, lifted by pytorch PR 138787 for 2.6)
and fail the compilation. pycomm then
warns and runs the module again with no split for this DDP module from then on: fewer
pieces (one per frame), never an error. The retry runs the forward from its start: when
dynamo had already run part of it (a graph break before the higher-order op), that part
runs twice in that one step (BatchNorm statistics, random numbers).
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import DDPConfig
from .compat import TORCH_DDP

DYNAMO_FIRST_PIECE_BYTES = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
"""dynamo's first-piece cap (torch's first bucket): its later caps may not be smaller."""

_PYTHON_REDUCER_MODES = ("python_reducer", "python_reducer_without_compiled_forward")
_REFUSED_SPLIT = "Found a higher order op"  # torch < 2.6's DDPOptimizer error


def split_bytes(config: DDPConfig) -> int:
    """The cap dynamo cuts the graph at: See Note [Graph split at pycomm's buckets]."""
    return max(config.bucket_byte_limits()[-1], DYNAMO_FIRST_PIECE_BYTES)


class SplitHint:
    """What pycomm's forward names as torch's active DDP module: `ddp` itself to whoever
    asks, except for `bucket_bytes_cap`, which is the cap dynamo splits the graph at
    (split_bytes) rather than the DDP module's own largest bucket cap."""

    def __init__(self, ddp: nn.Module):
        self._ddp = ddp  # made on every forward: nothing computed here

    @property
    def bucket_bytes_cap(self) -> int:  # read by dynamo alone, when it compiles
        return split_bytes(self._ddp.config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ddp, name)


def _no_callback() -> None:
    return None


# dynamo's frame callback now (None: nothing compiles the frames being called), a C
# function; a torch without it reports none.
eval_frame_callback: Callable[[], Any] = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback",
    _no_callback)


def module_compiled(module: nn.Module) -> bool:
    """Whether the wrapped module itself was compiled (torch.compile(module), or
    module.compile()): its call runs a compiled graph even when the DDP's does not."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _call_module(module: torch.nn.Module, inputs: tuple, kwargs: dict) -> Any:
    """The frame dynamo compiles under torch.compile(ddp): the module's call, inlined."""
    return module(*inputs, **kwargs)


# Note [Frames dynamo sees]
# DistributedDataParallel.forward, call_module and _call_as_active are skipped by dynamo,
# but not what they call, so that _call_module is compiled (torch._disable_dynamo with
# recursive=False); anything else they call (a constructor, an nn.Module attribute
# lookup) would be a frame dynamo analyses on every step, so they call only _call_module
# and helpers disabled recursively. torch's non-recursive disable also sends each call
# through dynamo's Python frame callback (1.4 ms a step for these three frames on the
# 2-core test machine; torch's own DDP frames are skipped in C, their file being on
# dynamo's skip list): once dynamo is imported, the first forward marks these frames' code
# skipped in C (mark_skipped_frames), so later steps pay nothing.
_SKIPPED_CODE: list[types.CodeType] = []
_marked = False


def skipped_frame(fn: Callable) -> Callable:
    """`fn`, whose frame dynamo skips while compiling what it calls (See Note [Frames
    dynamo sees])."""
    _SKIPPED_CODE.append(fn.__code__)
    return torch._disable_dynamo(fn, recursive=False)


def mark_skipped_frames() -> None:
    """Mark the skipped frames' code for dynamo's C-level skip, once dynamo is imported;
    called on every forward, a flag test after the first time."""
    global _marked
    if _marked or "torch._dynamo" not in sys.modules:
        return
    _marked = True
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # a torch without it: the Python callback still skips them
        return
    for code in _SKIPPED_CODE:
        skip_code(code)


@skipped_frame
def _call_as_active(hint: SplitHint | None, module: torch.nn.Module, inputs: tuple,
                    kwargs: dict) -> Any:
    # Saved and restored, as torch's DDP does, so that a DDP module nested in another one
    # hands the outer one's hint back when it returns.
    previous = TORCH_DDP._active_ddp_module
    TORCH_DDP._active_ddp_module = hint
    try:
        return _call_module(module, inputs, kwargs)
    finally:
        TORCH_DDP._active_ddp_module = previous


@skipped_frame
def call_module(ddp: nn.Module, split: GraphSplit, inputs: tuple, kwargs: dict) -> Any:
    """ddp.module(*inputs, **kwargs), split for dynamo at pycomm's buckets when compiled.
    See Note [Graph split at pycomm's buckets] and Note [Refused split]."""
    hint, module = split.of(ddp)
    try:
        return _call_as_active(hint, module, inputs, kwargs)
    except Exception as error:
        if hint is None or not split.refuse(error):
            raise
    return _call_as_active(None, module, inputs, kwargs)


class GraphSplit:
    """Whether dynamo still splits one DDP module's graph at its buckets: until this torch
    refuses to (See Note [Refused split]), then never again for that module."""

    def __init__(self, refused: bool = False):
        self.refused = refused

    @torch._disable_dynamo
    def of(self, ddp: nn.Module) -> tuple[SplitHint | None, nn.Module]:
        """The hint to name as torch's active DDP module (None: no split), and the module."""
        return (None if self.refused else SplitHint(ddp)), ddp.module

    @torch._disable_dynamo
    def refuse(self, error: BaseException) -> bool:
        """Whether `error` is dynamo refusing the split (then never asked for again)."""
        if not _is_refused_split(error):
            return False
        self.refused = True
        warnings.warn("pycomm DDP: this torch's dynamo cannot split a graph holding a "
                      "higher-order op (torch.utils.checkpoint, torch.cond, ...) at pycomm's "
                      "buckets; the module is compiled without the split from now on: its "
                      "buckets launch when its compiled backward ends, with less overlap. "
                      "See Note [Refused split] in pycomm/ddp/compile.py.", stacklevel=2)
        return True


def _is_refused_split(error: BaseException) -> bool:
    exc = sys.modules.get("torch._dynamo.exc")
    return (exc is not None and isinstance(error, exc.BackendCompilerFailed)
            and _REFUSED_SPLIT in str(error))


def warn_if_python_reducer() -> None:
    """torch's optimize_ddp="python_reducer" modes replace torch's C++ reducer with a
    Python one that compiled autograd traces; pycomm has none, and in those modes dynamo
    does not split the graph. Read only when torch._dynamo was imported (the setting
    lives there)."""
    dynamo = sys.modules.get("torch._dynamo")
    mode = getattr(getattr(dynamo, "config", None), "optimize_ddp", None)
    if mode in _PYTHON_REDUCER_MODES:
        warnings.warn(f"pycomm DDP: torch._dynamo.config.optimize_ddp={mode!r} is torch's "
                      f"Python reducer for compiled autograd, which pycomm does not have: "
                      f"pycomm keeps its C++ reducer, dynamo does not split a compiled graph "
                      f"in this mode (all buckets launch after the compiled backward), and "
                      f"a backward under compiled autograd raises. Use "
                      f"optimize_ddp='ddp_optimizer' (the default) with torch.compile.",
                      stacklevel=3)
