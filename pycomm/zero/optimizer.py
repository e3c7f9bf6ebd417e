"""pycomm.ZeroRedundancyOptimizer: torch's constructor and API; each rank keeps and steps
the optimizer state of its shard only (See Note [Flat shards of a bucket] in layout.py).

Note [Two gradient modes]
By default it keeps torch's contract: on a pycomm DDP the buckets are all-reduced as
without sharding, and after a synchronized backward, until step() or zero_grad(),
param.grad holds the averaged gradient (as under torch's ZeroRedundancyOptimizer, and as
Megatron's distributed optimizer keeps its full gradient buffer). torch's
clip_grad_norm_, GradScaler, gradient logging and the trainers then see what they see
with torch's classes. The step reads its pieces out of param.grad (or param.main_grad
where the DDP's main_grad_only leaves param.grad None: what the DDP's clip scales), steps
them (1/world of the optimizer's state and memory traffic) and all-gathers the
parameters. Its gradients cost what the DDP's do.
release_gradients=True (ZeRO-2) is the opt-in of less memory: each bucket is
reduce-scattered and released (Note [Sharding on the reducer] in binding.py), so
param.grad is None after a synchronized backward; torch's clip_grad_norm_ then clips
nothing and torch's GradScaler finds no gradients (it raises). Clip with the DDP's,
pycomm's or this optimizer's clip_grad_norm_ and scale with pycomm.ShardedGradScaler,
which read the shards.

Without a pycomm DDP (gradients already averaged in param.grad, e.g. by torch's DDP) it
does what torch's ZeroRedundancyOptimizer does, on flat shards: step its pieces, all-gather
the parameters.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from .. import _C, adam_step, ops
from ..clip import clip_from_partial
from .binding import DDPBinding
from .checkpoint import ShardedStateDicts
from .flat import FlatShards
from .gathers import GatherLog

# Optimizers whose update of an element reads only that element's gradient and state, and
# so step flat pieces exactly as whole tensors (See Note [Flat shards of a bucket]).
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam",
    "Rprop", "ASGD"))


class ZeroRedundancyOptimizer(DDPBinding, FlatShards, ShardedStateDicts, Optimizer,
                              Joinable):
    """torch.distributed.optim.ZeroRedundancyOptimizer's constructor, API and contract, with
    flat shards and all-gathered parameters (See Note [Two gradient modes]). The parts:
    DDPBinding (binding.py: whose parameters, the DDP side, where the gradients are read),
    FlatShards (flat.py: the buffers, the pieces, the all-gather), ShardedStateDicts
    (checkpoint.py); here the optimizer's front: step, zero_grad, the clip, the scaler's
    unscale, add_param_group, join."""

    def __init__(self, params: Iterable, optimizer_class: type[Optimizer],
                 process_group: Optional[dist.ProcessGroup] = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 release_gradients: bool = False, **defaults: Any):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE)):
            name = getattr(optimizer_class, "__name__", repr(optimizer_class))
            raise ValueError(
                f"ZeroRedundancyOptimizer: {name} is not an elementwise optimizer; flat shards "
                f"step a parameter in pieces, exact only for optimizers whose update of an "
                f"element reads that element alone: "
                f"{', '.join(c.__name__ for c in ELEMENTWISE)} (and subclasses)")
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        self._optimizer_class = optimizer_class
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.overlap_with_ddp = overlap_with_ddp
        # See Note [Two gradient modes]
        self.release_gradients = bool(release_gradients)
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        ddp = self._find_ddp()
        if ddp is not None:
            self.process_group = ddp.process_group if process_group is None else process_group
        else:
            self.process_group = process_group or dist.distributed_c10d._get_default_group()
        self._bind(ddp)
        self._pending: dict[int, Any] = {}  # bucket -> its parameter all-gather's work
        # all-gathers still pending when the optimizer goes (overlap_with_ddp=True leaves
        # the last step's running) are waited for then: a process group destroyed under a
        # running collective aborts the process
        weakref.finalize(self, _drain, self._pending)
        self.gathers = GatherLog()
        self._signature = None
        self._holds_state = False  # stepped, or loaded: a re-cut must move the state
        self._first_grads = None  # See Note [The first step's buckets]
        self.optim: Optional[Optimizer] = None
        # what stepped the pieces last: "pycomm one-pass Adam" (pycomm/adam_step.py), or the
        # wrapped optimizer's own step and why the one-pass step did not run
        self.step_kernel: Optional[str] = None
        self._relayout(whole=None)
        if self._ddp is not None:
            self._attach(self._ddp)

    # ---- the step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any):
        """torch's: `closure` and `kwargs` go to the wrapped optimizer's step, whose return
        is returned. A callable closure (the forward and backward) runs first, here, so
        that the pieces are given the gradients it computed; the wrapped optimizer's step
        is then handed a closure returning its loss."""
        Join.notify_join_context(self)  # a joined rank shadows this step (join_hook)
        loss = None
        if callable(closure):
            with torch.enable_grad():
                loss = closure()
        self._follow_buckets()
        self._sync_groups()
        for (_, _, main), run in zip(self._pieces, self._grad_runs()):
            main.grad = run if run is None or run.dtype == main.dtype else run.to(main.dtype)
        forwarded = kwargs or (closure is not None and not callable(closure))
        why = adam_step.try_step(self.optim) if not forwarded else "step() was given arguments"
        if why is None:
            self.step_kernel = adam_step.ONE_PASS_STEP
        else:
            if callable(closure):
                loss = self.optim.step(closure=lambda: loss, **kwargs)
            elif closure is not None:
                loss = self.optim.step(closure=closure, **kwargs)
            else:
                loss = self.optim.step(**kwargs)
            self.step_kernel = f"{type(self.optim).__name__}.step ({why})"
        self._holds_state = True
        self._first_grads = None
        if self._ddp is not None:  # consumed: a joined rank's shadow never zero_grads
            self._hook_state.clear()
        self._sync_groups(into_inner=False)
        for shard, piece, main in self._pieces:
            run = self._flat[shard.index][piece.flat:piece.flat + piece.numel]
            if run.data_ptr() != main.data_ptr():
                run.copy_(main)
        self._broadcast_tails()
        self._gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._ddp is not None:  # the shards the hook kept are this optimizer's grads
            self._hook_state.clear()
            self._first_grads = None
        for p in self._all_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_() if p.grad.grad_fn is not None else p.grad.zero_()
        for _, _, main in self._pieces:
            main.grad = None

    # ---- clipping ----------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        parameters: Optional[Iterable[torch.Tensor]] = None) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as torch.nn.utils.
        clip_grad_norm_ over the whole model would. Where they are whole in param.grad (the
        default: Note [Two gradient modes]) they are clipped there, by the DDP's clip or as
        pycomm.clip_grad_norm_ does; released, from the shards: each rank's norm partial of
        the runs it owns, one all-reduce, the pieces scaled (Note [Clipping from partials]
        in pycomm/clip.py). Inside the DDP's no_sync (local gradients in param.grad,
        nothing reduced) it clips param.grad as pycomm.clip_grad_norm_ does. `parameters`
        (default: all it shards) restricts the norm and the scaling to those, as torch's
        clip of a subset does. Collective."""
        if self._ddp is None:
            self._adopt_ddp()  # See Note [Wrapped after the optimizer]: before the indices
        chosen = None if parameters is None else {
            self._index[id(p)] for p in parameters if id(p) in self._index}
        if self._ddp is not None and chosen is None and not self.grads_in_shards:
            return self._ddp.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        if not self.grads_in_shards or not self._ddp.require_backward_grad_sync:
            local = self._params if chosen is None else [self._params[i] for i in sorted(chosen)]
            return _C._clip_grad_norm_(local, float(max_norm), float(norm_type),
                                       bool(error_if_nonfinite))
        self._follow_buckets()
        norm_type = float(norm_type)
        runs = [run for (_, piece, _), run in zip(self._pieces, self._grad_runs())
                if run is not None and (chosen is None or piece.param in chosen)]
        # every rank's partial in one dtype (they are all-reduced), the norm in torch's
        wide = any(p.dtype == torch.float64 for p in self._params)
        norm_dtype = torch.float64 if wide else torch.float32
        device = self._params[0].device
        partial = ops.norm_partial(runs, norm_type).to(norm_dtype) if runs else \
            torch.zeros(2, dtype=norm_dtype, device=device)
        inf = norm_type == float("inf")
        dist.all_reduce(partial, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                        group=self._comm_group)
        return clip_from_partial(runs, partial, max_norm, norm_type, error_if_nonfinite,
                                 norm_dtype)

    @torch.no_grad()
    def unscale_shards_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """ShardedGradScaler's unscale (See Note [Loss scaling over shards] in
        grad_scaler.py): every gradient run this rank steps is multiplied by inv_scale
        and checked, found_inf (a 0-dim float32 tensor, the scaler's) set to 1 where any
        rank found one not finite. Returns {device: found_inf}, as torch's GradScaler's
        _unscale_grads_ does. Without a pycomm DDP the gradients are whole in param.grad,
        and all of them are unscaled, as torch's scaler does. Collective."""
        self._follow_buckets()  # adopts a DDP that took the parameters since construction
        if not self.grads_in_shards:  # what the step reads: param.grad (or main_grad)
            grad_of = (lambda p: p.grad) if self._ddp is None else self._ddp.synced_grad
            runs = [g for g in map(grad_of, self._all_params) if g is not None]
        else:
            runs = [r for r in self._grad_runs() if r is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for run in runs:
            if run.dtype == torch.float16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            by_dtype.setdefault(run.dtype, []).append(run)
        device = self._params[0].device  # the group's: where the flag is all-reduced
        flag = found_inf if found_inf.device == device else found_inf.to(device)
        for runs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(runs, flag, inv_scale.to(device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._comm_group)
        if flag is not found_inf:
            found_inf.copy_(flag)
        return {found_inf.device: found_inf}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's: after construction the buckets are cut anew over every parameter, the
        state held moved onto the new pieces. On a pycomm DDP every trainable parameter of
        the module is in the optimizer from the start, so a new group may hold only
        parameters that never get a gradient (frozen ones). Collective, as torch's is in
        effect: every rank must add the same group."""
        constructed = getattr(self, "optim", None) is not None
        if constructed:
            self.wait_for_params()
            self._follow_buckets()
        super().add_param_group(param_group)
        try:
            _refuse_sparse(self.param_groups[-1:], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()  # the refused group is not kept
            raise
        if not constructed:
            return
        added = self.param_groups[-1]["params"]
        if self._ddp is not None and any(p.requires_grad for p in added):
            self.param_groups.pop()
            at = len(self.param_groups)
            raise ValueError(
                f"ZeroRedundancyOptimizer (rank {self.global_rank}): add_param_group on a "
                f"pycomm DistributedDataParallel's parameters: param_groups[{at}] "
                f"holds a trainable parameter that is not the DDP's (every parameter of the "
                f"DDP is in the optimizer from construction); wrap it in the DDP's module "
                f"before building both, or freeze it")
        whole = self._whole_states() if self._holds_state else None
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._bind(self._ddp)
        self._relayout(whole)

    # ---- join -------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group


def _refuse_sparse(groups: list[dict], first: int = 0) -> None:
    """torch's refusal of sparse parameters (a ValueError naming the parameter); flat
    shards are runs of dense memory."""
    for g, group in enumerate(groups, first):
        for i, p in enumerate(group["params"]):
            if p.layout != torch.strided:
                raise ValueError(
                    f"ZeroRedundancyOptimizer: param_groups[{g}]['params'][{i}] is a "
                    f"{p.layout} tensor (shape {tuple(p.shape)}); only dense (torch.strided) "
                    f"parameters can be sharded: flat shards are runs of the parameters' "
                    f"memory")


def _drain(pending: dict[int, Any]) -> None:
    for work in list(pending.values()):
        # the group may already be gone: nothing left to protect then
        with contextlib.suppress(Exception):
            work.wait()
    pending.clear()


class _ZeroJoinHook(JoinHook):
    """A joined rank's shadow of step(), after the DDP's shadow of the backward, which
    left this rank the others' averaged gradients (in param.grad: the DDP's hand-over;
    released, in its kept range): it steps and all-gathers them as they do (its shard
    must stay current), then drops them, so that nothing stale is left in param.grad when
    the join ends."""

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()
        self.zero.zero_grad()


__all__ = ["ZeroRedundancyOptimizer"]
