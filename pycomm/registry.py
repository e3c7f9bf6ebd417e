"""Who owns a parameter, for the parts of pycomm handed only parameters: which pycomm
DistributedDataParallel reduces its gradient (registered at the DDP's construction, read by
pycomm.ZeroRedundancyOptimizer, which then attaches itself to that DDP, and by
pycomm.clip_grad_norm_, which asks the DDP for its sharder). Weak both ways: nothing here
keeps a parameter or a DDP alive. A module of its own so that the DDP and the optimizer
import neither each other."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

# id(param) -> (param, owner), both weak; keyed by id as tensors compare elementwise. An
# entry whose parameter died (and whose id may be reused) is recognized by its dead reference.
_Table = dict[int, tuple[weakref.ref, weakref.ref]]
_ddps: _Table = {}


def _register(table: _Table, owner: Any, params: list[torch.Tensor]) -> None:
    for key in [k for k, (p, o) in table.items() if p() is None or o() is None]:
        del table[key]
    ref = weakref.ref(owner)
    for p in params:
        table[id(p)] = (weakref.ref(p), ref)


def _lookup(table: _Table, param: torch.Tensor) -> Optional[Any]:
    refs = table.get(id(param))
    if refs is None or refs[0]() is not param:
        return None
    return refs[1]()


def register_ddp(ddp: Any, params: list[torch.Tensor]) -> None:
    _register(_ddps, ddp, params)


def ddp_of(param: torch.Tensor) -> Optional[Any]:
    """The live pycomm DDP reducing `param`'s gradient, or None."""
    return _lookup(_ddps, param)
