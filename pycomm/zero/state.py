"""Moving pycomm.ZeroRedundancyOptimizer's state between shards and whole parameters: the
consolidated state dict (a plain optimizer's), the sharded one (a rank's pieces), and
re-cutting either onto another layout or world size.

Note [Piece state]
An elementwise optimizer keeps, per piece it steps, tensors shaped like the piece (1-D:
exp_avg, exp_avg_sq, momentum_buffer...) and scalars (step, as a 0-dim tensor or a
number). A piece's tensor state is a run of the whole parameter's; its scalars are the
parameter's, equal on every rank that holds a piece of it (every piece of a parameter
steps together: its gradient is present or absent on all ranks alike). So the whole
state of a parameter is its pieces' runs laid back to back, plus any one piece's scalars;
and any cut of a whole state is its runs sliced, scalars copied.
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import Piece

SHARD_FORMAT = "pycomm.ZeroRedundancyOptimizer shard v1"
# The state entry holding a low-precision parameter's fp32 main copy in state dicts (a
# plain optimizer loading a consolidated dict keeps it and never reads it).
MAIN_KEY = "pycomm_main_param"
# The state entries of torch's elementwise optimizers that are one number per parameter
# (a count, a learning-rate product), whatever their shape: for a 0-dim parameter, a
# tensor of the parameter's shape is no sign of a per-element entry.
SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def is_run(key: str, value: Any, piece: Piece) -> bool:
    """Whether a piece's state value is a run of the parameter (tensor state), not a
    scalar."""
    return (key not in SCALAR_KEYS and isinstance(value, torch.Tensor) and value.dim() == 1
            and value.numel() == piece.numel)


def whole_states(runs: list[tuple[Piece, dict]], shapes: list[torch.Size]) -> dict[int, dict]:
    """Per parameter index, its whole state from pieces covering it (duplicates, as the
    tail's on every rank, are fine): runs laid out on CPU, scalars from any piece."""
    out: dict[int, dict] = {}
    for piece, state in runs:
        whole = out.setdefault(piece.param, {})
        for key, value in state.items():
            if is_run(key, value, piece):
                if key not in whole:
                    whole[key] = torch.zeros(shapes[piece.param], dtype=value.dtype)
                whole[key].view(-1)[piece.lo:piece.hi] = value.detach().cpu()
            elif key not in whole:
                whole[key] = value.detach().cpu().clone() if isinstance(
                    value, torch.Tensor) else value
    return out


def cut_state(whole: dict, piece: Piece, shape: torch.Size) -> dict:
    """A piece's state out of its parameter's whole state."""
    out = {}
    for key, value in whole.items():
        if key not in SCALAR_KEYS and isinstance(value, torch.Tensor) and value.shape == shape:
            out[key] = value.reshape(-1)[piece.lo:piece.hi].clone()
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def shard_runs(shard: dict) -> list[tuple[Piece, dict]]:
    """The (piece, state) runs of a sharded state dict (ZeroRedundancyOptimizer's
    sharded_state_dict)."""
    if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT:
        found = shard.get("format") if isinstance(shard, dict) else type(shard).__name__
        raise ValueError(f"not a sharded state dict of pycomm.ZeroRedundancyOptimizer (its "
                         f"'format' is {found!r}, expected {SHARD_FORMAT!r})")
    return [(Piece(*p), s) for p, s in zip(shard["pieces"], shard["state"])]
