"""The two sides of sharding on a pycomm DistributedDataParallel, named so that neither
reads the other's private names (See Note [Sharding on the reducer] in
pycomm/zero/binding.py):
- Sharder: what the DDP asks of the sharded optimizer attached to it (its forward waits
  for the optimizer's parameter all-gathers, its clip and pycomm's ask it for the norm
  where the gradients live in its shards, join waits for its all-gathers);
- ShardedReduction: what the optimizer asks of the DDP's reducer, given whole when it
  attaches: its mode (Sharding), and in the released mode its communication hook
  and the hook's form for gradients reduced where they are. The reducer decides its plan
  from it (Note [The reducer's plan] in csrc/reducer/plan.h); the optimizer attaches
  again, whole, when its shards become final (Note [The first step's buckets]).
The optimizer reads the DDP through its public methods only (bucket_indices,
unused_parameters, wire, plan, gradient_group, reduced_named_parameters, synced_grad,
rebuild_buckets_if_due)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from .._C import Sharding


@runtime_checkable
class Sharder(Protocol):
    """An optimizer that shards a DDP's parameters (pycomm.ZeroRedundancyOptimizer)."""

    @property
    def grads_in_shards(self) -> bool:
        """Whether the averaged gradients live in the shards rather than in param.grad:
        then the clips ask the sharder for the norm."""

    def covers(self, params: list[torch.Tensor]) -> bool:
        """Whether `params` are all parameters it shards (or frozen ones)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        parameters: Optional[Iterable[torch.Tensor]] = None) -> torch.Tensor:
        """Clip the gradients in its shards by their global norm (collective)."""

    def before_module_call(self, compiled: bool) -> None:
        """The DDP's forward, before it calls its module."""

    def wait_for_params(self) -> None:
        """Every pending parameter all-gather done."""


@dataclass(frozen=True)
class ShardedReduction:
    """What a sharder asks of the DDP's reducer. `sharding`: Sharding.OPTIMIZER_STATE (the
    gradients stay whole in param.grad; the sharder steps its shard of them) or
    Sharding.RELEASED: the sharder keeps the averaged gradients of its range itself. The
    reducer then pre-divides each gradient by the world size as it copies it into the
    bucket (as without a hook), so `hook` only sums: hook(state, dist.GradBucket) -> Future
    (torch's protocol); in_place_hook(state, bucket, reduce_into) -> Future is its form for
    gradients reduced where they are (ShardHook in csrc/reducer/comm_hook.h), used when
    `in_place`. Whether the reducer drops each gradient once it is in its bucket is its
    plan's (ddp.plan["releases"]; Note [Released gradients] in csrc/reducer/launch.cpp)."""
    sharding: Sharding
    state: Any = None
    hook: Optional[Callable[..., Any]] = None
    in_place_hook: Optional[Callable[..., Any]] = None
    in_place: bool = False


def check_sharder(sharder: Any) -> None:
    """A TypeError naming what `sharder` lacks of the Sharder protocol."""
    if isinstance(sharder, Sharder):
        return
    missing = [name for name in ("grads_in_shards", "covers", "clip_grad_norm_",
                                 "before_module_call", "wait_for_params")
               if not hasattr(sharder, name)]
    raise TypeError(f"attach_sharder: a {type(sharder).__name__} is not a sharder "
                    f"(pycomm.ddp.sharding.Sharder): it has no {', '.join(missing)}")
