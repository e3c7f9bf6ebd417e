"""Which pycomm DistributedDataParallel reduces a parameter's gradient: registered at
construction, read by what builds on a DDP it is handed only the parameters of
(pycomm.ZeroRedundancyOptimizer). Weak both ways: neither keeps the other alive."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

# id(param) -> (param, DDP), both weak; keyed by id as tensors compare elementwise. An entry
# whose parameter died (and whose id may be reused) is recognized by its dead reference.
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register(ddp: Any, params: list[torch.Tensor]) -> None:
    for key in [k for k, (p, d) in _owners.items() if p() is None or d() is None]:
        del _owners[key]
    ref = weakref.ref(ddp)
    for p in params:
        _owners[id(p)] = (weakref.ref(p), ref)


def owner_of(param: torch.Tensor) -> Optional[Any]:
    """The live pycomm DDP reducing `param`'s gradient, or None."""
    refs = _owners.get(id(param))
    if refs is None or refs[0]() is not param:
        return None
    return refs[1]()
