"""The two sides of sharding on a pycomm DistributedDataParallel, named so that neither
reads the other's private names (See Note [Sharding on the reducer] in
pycomm/zero/binding.py):
- Sharder: what the DDP asks of the sharded optimizer attached to it (its forward waits
  for the optimizer's parameter all-gathers, its clip and pycomm's ask it for the norm
  where the gradients live in its shards, join waits for its all-gathers);
- ShardedReduction: what the optimizer asks of the DDP's reducer, given whole when it
  attaches: its mode (Sharding), and in the released mode what keeps the rank's range
  of each bucket (a C++ ShardKeep) and whether its shards are final. The reducer decides its plan
  from it (Note [The reducer's plan] in csrc/reducer/plan.h); the optimizer attaches
  again, whole, when its shards become final (Note [The first step's buckets]).
The optimizer reads the DDP through its public methods only (bucket_indices,
unused_parameters, wire, plan, gradient_group, reduced_named_parameters, synced_grad,
rebuild_buckets_if_due)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from .._C import Sharding, Wire


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
    Sharding.RELEASED: the sharder keeps the averaged gradients of its range itself, in
    `keep` (a _C.ShardKeep, which reduces each bucket: Note [Shards kept in C++] in
    csrc/reducer/shard_hook.h), `final` once its shards are cut on the re-cut buckets
    (then a bucket is reduced where its gradients are, where the group allows).
    `shadow(state, dist.GradBucket) -> Future` (torch's hook protocol, over `state`) is what
    a joined rank runs in the others' place (pycomm/ddp/join.py). The reducer pre-divides
    each gradient by the world size as it copies it into the bucket (as without a hook),
    so the collectives only sum. Whether the reducer drops each gradient once it is in its
    bucket is its plan's (ddp.plan["releases"]; Note [Released gradients] in
    csrc/reducer/launch.cpp)."""
    sharding: Sharding
    keep: Any = None
    final: bool = False
    state: Any = None
    shadow: Optional[Callable[..., Any]] = None


def check_sharder(sharder: Any) -> None:
    """A TypeError naming what `sharder` lacks of the Sharder protocol."""
    if isinstance(sharder, Sharder):
        return
    missing = [name for name in ("grads_in_shards", "covers", "clip_grad_norm_",
                                 "before_module_call", "wait_for_params")
               if not hasattr(sharder, name)]
    raise TypeError(f"attach_sharder: a {type(sharder).__name__} is not a sharder "
                    f"(pycomm.ddp.sharding.Sharder): it has no {', '.join(missing)}")


class ShardingSide:
    """The DDP's side (mixed into pycomm.DistributedDataParallel): a sharder attaches here,
    and reads the DDP through these methods only."""

    def attach_sharder(self, sharder: Sharder, reduction: ShardedReduction) -> None:
        """The sharded optimizer over this DDP's parameters (pycomm.ZeroRedundancyOptimizer
        attaches itself when it is built on the DDP, or moves onto it; See
        pycomm/ddp/sharding.py for both sides). The DDP's forward waits for its pending
        parameter all-gathers (before_module_call), the DDP's clip asks it for the norm
        where the gradients live in its shards (grads_in_shards, clip_grad_norm_), and
        join waits for its all-gathers (wait_for_params). Held weakly; a later one replaces
        it. The reducer replans from `reduction` (Note [The reducer's plan] in
        csrc/reducer/plan.h), also between steps after training began (See Note [Wrapped
        after the optimizer] in pycomm/zero/binding.py); the sharder attaches again, whole,
        to change it. A released sharder's collectives carry the DDP's wire
        (DDPConfig.wire_format) where it is in effect."""
        check_sharder(sharder)
        sharders = self.plan["sharding"] == "released"  # the hook now is a sharder's
        if reduction.keep is not None and self._sync.comm_hook is not None and not sharders:
            raise RuntimeError("ZeroRedundancyOptimizer on a pycomm DDP replaces its bucket "
                               "collective with a reduce-scatter; this DDP already has a "
                               "communication hook registered")
        self.reducer.attach_sharding(reduction.sharding, reduction.keep, reduction.final)
        # what join's shadow runs (join.py) follows the reducer: the new sharder's, or
        # none once a sharder keeping the gradients whole replaced one that kept its range
        if reduction.keep is not None:
            self._sync.comm_hook = (reduction.state, reduction.shadow)
        elif sharders:
            self._sync.comm_hook = None
        self._sharder = weakref.ref(sharder)

    @property
    def sharder(self) -> Optional[Sharder]:
        """The attached sharded optimizer, while it lives (attach_sharder), or None."""
        ref = getattr(self, "_sharder", None)
        return None if ref is None else ref()

    @property
    def plan(self) -> dict:
        """What the reducer decided for its steps (See Note [The reducer's plan] in
        csrc/reducer/plan.h): "sharding" ("none", "optimizer_state", "released"),
        "reduction" (what reduces the buckets: "allreduce", "python_hook" for a comm hook,
        "shard_keep" for a released sharder's reduce-scatter, in C++), "wire"
        (a pycomm.Wire, None under a comm hook), "releases" (each gradient dropped once in
        its bucket), "reducer_averages" (the collective only sums), and "paths" (per
        bucket: "buffer", "in_place", "released", "released_in_place"; a step whose
        gradients share memory takes its buckets through their buffers)."""
        return self.reducer.plan

    @property
    def reduced_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters whose gradients the reducer reduces, with their names, in the
        reducer's index order (bucket_indices() indexes this list)."""
        return list(self._named_params)

    def bucket_indices(self) -> list[list[int]]:
        """The reducer's buckets, in launch order: each a list of indices into
        reduced_named_parameters, in slot order."""
        return [list(b) for b in self.reducer.bucket_indices()]

    def unused_parameters(self) -> list[int]:
        """Indices (into reduced_named_parameters) of the parameters the last synchronized
        step left unreduced because no rank used them (find_unused_parameters,
        static_graph): their param.grad stayed as it was, as torch's DDP leaves it."""
        return list(self.reducer.unused_parameters())

    @property
    def wire(self) -> Optional[Wire]:
        """What the bucket all-reduce sends across hosts (DDPConfig.wire where the group
        spans hosts, else fp32), or None while a communication hook reduces the buckets."""
        return self.reducer.wire

    def rebuild_buckets_if_due(self) -> bool:
        """Re-cut the buckets now if the one re-cut after the first synchronized step is
        due (the next forward would run it); whether it ran. Collective."""
        return self._sync.rebuild_buckets_if_due()
