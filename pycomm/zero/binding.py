"""How pycomm.ZeroRedundancyOptimizer binds to the parameters it shards, a mixin of the
optimizer (DDPBinding): to a pycomm DistributedDataParallel's (its bucket order, its
communication hook with released gradients, its re-cut, its forward) or to its own, and
where each piece's gradient is read after a backward.

Note [Sharding on the reducer]
With release_gradients=True, on the parameters of a pycomm.DistributedDataParallel it
changes what the DDP's reducer
does with each bucket (its hook, attached whole with Sharding.RELEASED: the reducer plans
from it, Note [The reducer's plan] in csrc/reducer/plan.h; the reducer
still pre-divides each gradient by the world size as it copies it into the bucket, so the
collectives only sum, with DDP's numerics):
- backward: a bucket's gradients are reduce-scattered the moment the bucket is complete
  on the DDP's gradient group (shared memory on one host, hierarchically across hosts:
  Note [Hierarchical reduce-scatter and all-gather] in csrc/shm/hier.h; NCCL's), so each
  rank receives the averaged gradients of its range only; the tail is all-reduced. On a
  plain Gloo group, whose reduce-scatter is one all-reduce per rank, the bucket is
  all-reduced instead (the same bytes as DDP). With the DDP's low-precision wire in
  effect (DDPConfig.wire across hosts), the reduce-scatter carries it: each host's sums
  cross once, encoded, and are added in float32 (Note [Low-precision wire] in
  csrc/shm/wire_codec.h). The reducer's ShardKeep (Note [Shards kept in C++] in
  csrc/reducer/shard_hook.h, no trip through Python)
  keeps the rank's range and the tail (hook.py's HookState.grads) and frees the bucket's storage;
  the reducer drops each param.grad once copied (Note [Released gradients] in
  csrc/reducer/launch.cpp). Over shared memory nothing is copied once the shards are
  final: the hook's in-place form reduce-scatters the gradients where they are, into the
  kept range (Note [Pieces reduce-scatter] in csrc/shm/collectives.cpp), and the reducer
  drops them once their bucket is done. Before the DDP's one bucket re-cut, whole buckets
  are all-reduced instead (Note [The first step's buckets]).
- step: the wrapped optimizer steps this rank's pieces: views of the parameters (fp32,
  fp64) or fp32 main copies of them (bf16, fp16: Megatron's main parameters), with the
  kept gradients (widened to fp32 for a low-precision bucket). 1/world of the optimizer's
  state and memory traffic per rank. On CPU torch's Adam and AdamW are stepped in one pass
  over memory, with their own bits (pycomm/adam_step.py; step_kernel says which step ran).
- then every bucket's parameters are all-gathered, last bucket first (the first layers
  are in the last bucket): each parameter is a view of its bucket's flat parameter buffer,
  which the all-gather fills in place. With overlap_with_ddp=True the all-gathers run
  behind the next forward: a forward pre-hook of each module waits for the buckets of its
  own parameters; the module's state_dict(), the next step() and wait_for_params() wait
  for all. Without it step() returns with the parameters gathered (torch's semantics). A
  module that reads another module's parameter before that module's forward ran (a tied
  weight used first by its second user) must call wait_for_params() itself.
Note [One rank: nothing to shard]
Released or not, on a gradient group of one rank each bucket's shard is the whole
bucket, and the hook
would only copy each gradient into its bucket and out again (1.28x the DDP's step on an
H200: the GPU record of 2026-11-26, in git history since, `git log -- benchmarks/results/
gpu_check_2026-11-26_nvidia-h200.md`). So there no hook is
registered: the DDP reduces as it does unsharded, param.grad keeps the gradients, and
the step reads its pieces out of param.grad, as after no_sync (_grad_runs); the
parameters are still views of the flat buffers, and nothing is all-gathered. The DDP's
one bucket re-cut is run by the first step that finds it due, before any state exists,
as with the hook (_follow_buckets). Released, with grad_reduce_dtype the hook stays: the
step needs the wide bucket, which param.grad holds only rounded to the parameter's
dtype (kept, it reads param.main_grad under main_grad_only).

Released on several ranks, param.grad after a synchronized backward is None (with
grad_reduce_dtype, whose buckets are kept: the bucket as copied by the DDP, averaged on
this rank's range only). ddp.clip_grad_norm_, pycomm.clip_grad_norm_ and this
optimizer's clip_grad_norm_ then take the global norm from the shards
(pycomm.ShardedGradScaler scales them: Note [Loss scaling over shards] in
grad_scaler.py).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C, registry
from .._C import Sharding
from ..ddp.sharding import ShardedReduction
from . import layout as shard_layout
from .hook import HookState, shadow_hook

_STANDALONE_BUCKET_BYTES = 25 * 1024 * 1024


class DDPBinding:
    # ---- where the parameters are ------------------------------------------------------

    def _bind(self, ddp) -> None:
        """Whose parameters these are and where they communicate: the DDP's, in its order,
        over its gradient group; or (ddp None) the optimizer's own, over process_group.
        Then the checks, the agreement across ranks included (collective)."""
        self._ddp = ddp
        if ddp is not None:
            named = ddp.reduced_named_parameters
            self._params = [p for _, p in named]
            self._names = [n for n, _ in named]
            self._comm_group = ddp.gradient_group
        else:
            self._params = list(self._all_params)
            self._names = [f"params[{i}]" for i in range(len(self._params))]
            self._comm_group = self.process_group
        self.world_size = dist.get_world_size(self._comm_group)
        self.rank = dist.get_rank(self._comm_group)
        self.global_rank = dist.get_global_rank(self._comm_group, self.rank)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._check_params()
        self._check_agreement()

    def _find_ddp(self):
        """The pycomm DDP whose trainable parameters these are (frozen ones, which never
        get a gradient, may be anyone's), or None."""
        trainable = [p for p in self._all_params if p.requires_grad]
        owners = {id(registry.ddp_of(p)): registry.ddp_of(p) for p in trainable}
        if not owners or (len(owners) == 1 and None in owners.values()):
            return None
        if None in owners.values() or len(owners) > 1:
            first = next(p for p in trainable if registry.ddp_of(p) is None) \
                if None in owners.values() else None
            what = (f"parameter {self._describe(first)} is not one of a "
                    f"pycomm.DistributedDataParallel's" if first is not None
                    else "its parameters belong to several DistributedDataParallel modules")
            raise ValueError(f"ZeroRedundancyOptimizer (rank {dist.get_rank()}): {what}; pass "
                             f"the parameters of one wrapped module (model.parameters() of "
                             f"the DDP), or none of a pycomm DDP")
        return next(iter(owners.values()))

    def _describe(self, p: torch.Tensor) -> str:
        for g, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
        return f"(shape {tuple(p.shape)})"

    def _check_params(self) -> None:
        mine = {id(p) for p in self._all_params}
        if self._ddp is None:
            return
        for name, p in zip(self._names, self._params):
            if not p.is_contiguous():
                raise ValueError(
                    f"ZeroRedundancyOptimizer (rank {self.global_rank}): parameter {name!r} is "
                    f"not contiguous (strides {p.stride()}, e.g. channels_last); the shards are "
                    f"flat runs of the DDP's buckets, laid out in the parameters' memory order: "
                    f"make the parameters contiguous before wrapping the module")
        missing = [n for n, p in zip(self._names, self._params) if id(p) not in mine]
        if missing:
            raise ValueError(
                f"ZeroRedundancyOptimizer (rank {self.global_rank}): the wrapped module's "
                f"parameter {missing[0]!r} (and {len(missing) - 1} more) is not in the "
                f"optimizer; on a pycomm DDP it shards every trainable parameter of the module "
                f"(the all-gather rewrites whole buckets): pass them all")

    def _check_agreement(self) -> None:
        """Every rank must shard the same parameters the same way: a rank whose groups,
        shapes or optimizer differ would run other collectives. Collective."""
        mine = (self._optimizer_class.__name__,
                [[tuple(p.shape) for p in g["params"]] for g in self.param_groups],
                shard_layout.signature(self._buckets()))
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._comm_group)
        what = ("optimizer class", "parameter groups (shapes)", "bucket layout")
        for rank, other in enumerate(everyone):
            for name, a, b in zip(what, everyone[0], other):
                if a != b:
                    raise ValueError(
                        f"ZeroRedundancyOptimizer: rank {rank} differs from rank 0 in its "
                        f"{name}: {_short(b)} against {_short(a)}; every rank must pass "
                        f"the same parameters, groups and optimizer (the shards are cut alike "
                        f"on every rank)")

    def _buckets(self) -> list[list[int]]:
        if self._ddp is not None:
            return self._ddp.bucket_indices()
        order = list(reversed(range(len(self._params))))
        return [sorted(b) for b in _C.assign_buckets(self._params, order,
                                                     [_STANDALONE_BUCKET_BYTES])]

    # ---- the DDP side -----------------------------------------------------------------

    def _attach(self, ddp) -> None:
        # Reduce-scatter where the backend has a real one: NCCL's, and pycomm's (shared
        # memory on one host; across hosts See Note [Hierarchical reduce-scatter and
        # all-gather] in csrc/shm/hier.h). Gloo's is an all-reduce per rank, so on Gloo
        # the bucket is all-reduced and the rank keeps its range.
        reduce_scatter = dist.get_backend(self._comm_group) in ("nccl", "pycomm")
        self._hook_state = HookState(ddp, self._comm_group, self._index, reduce_scatter)
        # See Note [One rank: nothing to shard]
        self._hooked = self.release_gradients and (
            self.world_size > 1 or ddp.config.grad_reduce_dtype is not None)
        self._attach_reduction(ddp)
        self._hook_handles = []
        self._map_modules()
        weak = weakref.ref(self)

        # Traced by dynamo when the module is compiled: is_compiling() makes them nothing
        # there (no graph break), and the DDP's eager forward waits for every bucket
        # before a compiled call instead (before_module_call).
        def wait_module(module, _args):
            if torch.compiler.is_compiling():
                return
            zero = weak()
            if zero is not None and zero._pending:
                zero._wait_buckets(zero._module_buckets.get(module, ()))

        def wait_all(*_args):
            if torch.compiler.is_compiling():
                return
            zero = weak()
            if zero is not None and zero._pending:
                zero.wait_for_params()

        for module in self._module_buckets:
            self._hook_handles.append(module.register_forward_pre_hook(wait_module))
        # what reads the parameters other than a module's forward
        self._hook_handles.append(ddp.module.register_forward_hook(wait_all))
        self._hook_handles.append(ddp.module.register_state_dict_pre_hook(wait_all))

    def _attach_reduction(self, ddp) -> None:
        """Attach to `ddp` with this optimizer's mode, whole (the reducer replans: Note
        [The reducer's plan] in csrc/reducer/plan.h): released, the hook, whose in-place
        form is used once the shards are final (Note [The first step's buckets]); else the
        optimizer state alone. Again whenever the shards become final."""
        state = self._hook_state
        if not self._hooked:
            ddp.attach_sharder(self, ShardedReduction(Sharding.OPTIMIZER_STATE))
            return
        ddp.attach_sharder(self, ShardedReduction(
            Sharding.RELEASED, state.keep, state.final, state, shadow_hook))

    def _shards_final(self) -> None:
        """See Note [The first step's buckets]: the buckets are final; the hook reduce-
        scatters them from now on (in place where the group allows)."""
        self._hook_state.final = True
        if self._hooked:
            self._attach_reduction(self._ddp)

    def _map_modules(self) -> None:
        """Per module of the DDP's with parameters of its own, the buckets they are in
        (what its forward pre-hook waits for); after every layout."""
        bucket_of = {i: shard.index for shard in self._shards for i in shard.params}
        self._module_buckets: dict[nn.Module, set[int]] = {}
        for module in self._ddp.module.modules():
            own = {bucket_of[self._index[id(p)]] for p in module.parameters(recurse=False)
                   if id(p) in self._index}
            if own:
                self._module_buckets[module] = own

    def before_module_call(self, compiled: bool) -> None:
        """The DDP's forward, before it calls its module: a compiled module's graph has
        no pre-hooks to wait in, so every pending all-gather is waited for here (the
        parameter all-gathers then overlap only the DDP's own pre-forward work)."""
        if compiled and self._pending:
            self.wait_for_params()

    def _wait_buckets(self, buckets) -> None:
        for b in buckets:
            work = self._pending.pop(b, None)
            if work is not None:
                start = time.perf_counter_ns()
                work.wait()
                self.gathers.waited(b, start)

    def gather_report(self, steps: int = 1) -> dict[str, float]:
        """The parameter all-gathers of the last `steps` steps: their span (first launch to
        last completion, median ms), the time the forward (or anything reading the
        parameters) waited for them, and the share hidden (1 - waited / span)."""
        return self.gathers.report(steps)

    def wait_for_params(self) -> None:
        """Wait for every pending parameter all-gather (overlap_with_ddp=True leaves them
        running behind the next forward)."""
        self._wait_buckets(list(self._pending))

    def _follow_buckets(self) -> None:
        """Pending all-gathers done, and the shards re-cut if the reducer re-cut its
        buckets: the state moves to the new pieces. First thing of whatever reads the
        pieces after a backward. Collective.

        Note [The first step's buckets]
        The reducer re-cuts its buckets once, from the gradient order of the first
        synchronized step. Until then (HookState.final False) the hook all-reduces whole
        buckets and keeps them; the first step (or the clip before it) does the re-cut
        itself, before the optimizer holds any state, cuts the shards anew and reads the
        first gradients out of the whole buckets. So the state never moves between ranks
        (but when it was loaded before the first step), and that first step holds whole
        gradients, as DDP does; every later one holds shards."""
        self.wait_for_params()
        if self._ddp is None:
            self._adopt_ddp()
            if self._ddp is None:
                return
        state = self._hook_state
        if not state.final and not self._hooked:  # the re-cut, once it is due
            state.final = self._ddp.rebuild_buckets_if_due()
        elif not state.final and state.keep.has_first:
            self._ddp.rebuild_buckets_if_due()
            self._first_grads = state.keep.take_first()
            self._shards_final()
        if shard_layout.signature(self._buckets()) != self._signature:
            self._relayout(self._whole_states() if self._holds_state else None)

    def _adopt_ddp(self) -> None:
        """Note [Wrapped after the optimizer]
        Accelerate's usual order, and the transformers Trainer's, builds the optimizer on
        the bare module and wraps the module afterwards (prepare()). Built so, this
        optimizer starts as torch's ZeroRedundancyOptimizer; the first time it reads
        gradients after a pycomm DDP took its parameters (the first step, or a clip before
        it), it moves onto the DDP as if built there. That backward was the DDP's own
        (whole averaged gradients in param.grad, which this step reads as after no_sync);
        the DDP's one bucket re-cut, due after it, is run now, so the shards are cut once
        on the final buckets; state already held (a checkpoint loaded first) is gathered
        whole from the old layout and cut anew. From the next backward on, the buckets are
        reduce-scattered and released. Collective (every rank reaches it in the same call:
        the same step, or the same clip)."""
        trainable = next((p for p in self._all_params if p.requires_grad), None)
        if trainable is None or registry.ddp_of(trainable) is None:
            return
        ddp = self._find_ddp()  # every parameter the one DDP's, or a named error
        whole = self._whole_states() if self._holds_state else None
        by_param = {} if whole is None else {id(self._params[i]): s for i, s in whole.items()}
        rebuilt = ddp.rebuild_buckets_if_due()
        self._bind(ddp)  # the DDP's order from here: the states follow their parameters
        if whole is not None:
            whole = {self._index[k]: s for k, s in by_param.items() if k in self._index}
        self._relayout(whole)
        self._attach(ddp)
        if rebuilt:  # See Note [The first step's buckets]: no re-cut is still to come
            self._shards_final()

    def _grad_runs(self) -> list[Optional[torch.Tensor]]:
        """Per piece (self._pieces' order), its averaged gradient run, or None where the
        parameter has none this step (torch's DDP leaves param.grad None for a parameter
        no rank used; zero_grad dropped it). On a pycomm DDP the runs are the shards the
        communication hook kept (See Note [Sharding on the reducer])."""
        grad_of = (lambda p: p.grad) if self._ddp is None else self._ddp.synced_grad
        local = [None if g is None else g.reshape(-1) for g in map(grad_of, self._params)]
        if self._ddp is None:
            return [None if local[piece.param] is None else
                    local[piece.param][piece.lo:piece.hi] for _, piece, _ in self._pieces]
        unused = set(self._ddp.unused_parameters())
        if self._first_grads is not None:  # See Note [The first step's buckets]
            return self._first_runs(local, unused)
        kept, fresh = self._hook_state.grads, self._hook_state.fresh
        runs: list[Optional[torch.Tensor]] = []
        for shard, piece, _ in self._pieces:
            flat = kept.get(shard.index) if shard.index in fresh else None
            if flat is None:  # no synchronized backward since zero_grad: what param.grad
                grad = local[piece.param]  # holds (no_sync's local sum), as unsharded
                runs.append(None if grad is None else grad[piece.lo:piece.hi])
                continue
            if piece.param in unused:
                runs.append(None)
                continue
            start = shard.ranges.kept_offset(piece.flat)
            runs.append(flat[start:start + piece.numel])
        return runs

    def _first_runs(self, local, unused) -> list[Optional[torch.Tensor]]:
        """_grad_runs of the first step: pieces read from the whole gradients it kept."""
        first = self._first_grads
        runs: list[Optional[torch.Tensor]] = []
        for _, piece, _ in self._pieces:
            if piece.param in unused:
                runs.append(None)
            elif piece.param not in first:
                grad = local[piece.param]
                runs.append(None if grad is None else grad[piece.lo:piece.hi])
            else:
                runs.append(first[piece.param][piece.lo:piece.hi])
        return runs

    @property
    def grads_in_shards(self) -> bool:
        """Whether the averaged gradients live in this optimizer's shards rather than in
        param.grad (See Note [Two gradient modes]): then the clips of pycomm and of the DDP
        ask it for the norm."""
        return self._ddp is not None and self._hooked

    def covers(self, params: list[torch.Tensor]) -> bool:
        """Whether `params` are all parameters this optimizer shards (or frozen ones)."""
        return all(id(p) in self._index or not p.requires_grad for p in params)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
