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
reduce-scattered and released as below, so param.grad is None after a synchronized
backward; torch's clip_grad_norm_ then clips nothing and torch's GradScaler finds no
gradients (it raises). Clip with the DDP's, pycomm's or this optimizer's
clip_grad_norm_ and scale with pycomm.ShardedGradScaler, which read the shards.

Note [Sharding on the reducer]
With release_gradients=True, on the parameters of a pycomm.DistributedDataParallel it
changes what the DDP's reducer
does with each bucket (a communication hook, registered at construction; the reducer
still pre-divides each gradient by the world size as it copies it into the bucket, so the
collectives only sum, with DDP's numerics):
- backward: a bucket's gradients are reduce-scattered the moment the bucket is complete
  on the DDP's gradient group (shared memory on one host, hierarchically across hosts:
  Note [Hierarchical reduce-scatter and all-gather] in csrc/shm/hier.h; NCCL's), so each
  rank receives the averaged gradients of its range only; the tail is all-reduced. On a
  plain Gloo group, whose reduce-scatter is one all-reduce per rank, the bucket is
  all-reduced instead (the same bytes as DDP). The hook
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
  over memory, with their own bits (adam_step.py; step_kernel says which step ran).
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
as with the hook (_follow_buckets). With grad_reduce_dtype the hook stays: the step needs
the wide bucket, which param.grad holds only rounded to the parameter's dtype.

Released on several ranks, param.grad after a synchronized backward is None (with
grad_reduce_dtype, whose buckets are kept: the bucket as copied by the DDP, averaged on
this rank's range only). ddp.clip_grad_norm_, pycomm.clip_grad_norm_ and this
optimizer's clip_grad_norm_ then take the global norm from the shards
(pycomm.ShardedGradScaler scales them: Note [Loss scaling over shards] in
grad_scaler.py).

Without a pycomm DDP (gradients already averaged in param.grad, e.g. by torch's DDP) it
does what torch's ZeroRedundancyOptimizer does, on flat shards: step its pieces, all-gather
the parameters.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from .. import _C, ops, registry
from ..clip import clip_from_partial
from . import adam_step
from . import layout as shard_layout
from .checkpoint import ShardedStateDicts
from .gathers import GatherLog
from .hook import HookState, reduce_scatter_hook, reduce_scatter_in_place_hook
from .layout import BucketShard, Piece

# Optimizers whose update of an element reads only that element's gradient and state, and
# so step flat pieces exactly as whole tensors (See Note [Flat shards of a bucket]).
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam",
    "Rprop", "ASGD"))

_STANDALONE_BUCKET_BYTES = 25 * 1024 * 1024
# torch 2.13 renamed the tensor forms (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_WIDENED = (torch.float16, torch.bfloat16)

class ZeroRedundancyOptimizer(ShardedStateDicts, Optimizer, Joinable):
    """torch.distributed.optim.ZeroRedundancyOptimizer's constructor and API, with flat
    shards, reduce-scattered gradients and all-gathered parameters on a pycomm DDP (See
    Note [Sharding on the reducer])."""

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
        # what stepped the pieces last: "pycomm one-pass Adam" (adam_step.py), or the
        # wrapped optimizer's own step and why the one-pass step did not run
        self.step_kernel: Optional[str] = None
        self._relayout(whole=None)
        if self._ddp is not None:
            self._attach(self._ddp)

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
            return [list(b) for b in self._ddp.reducer.bucket_indices()]
        order = list(reversed(range(len(self._params))))
        return [sorted(b) for b in _C.assign_buckets(self._params, order,
                                                     [_STANDALONE_BUCKET_BYTES])]

    # ---- the layout: flat parameter buffers, pieces, the wrapped optimizer ------------

    def _relayout(self, whole: Optional[dict[int, dict]]) -> None:
        """Cut the current buckets; parameters become views of per-bucket flat buffers; the
        wrapped optimizer is built over this rank's pieces and given `whole` (per parameter
        index, whole states) cut to them."""
        buckets = self._buckets()
        self._signature = shard_layout.signature(buckets)
        self._shards: list[BucketShard] = shard_layout.cut(
            buckets, self._params, self.world_size, self.rank, self._step_block())
        self._flat: list[torch.Tensor] = []
        with torch.no_grad():
            for shard in self._shards:
                first = self._params[shard.params[0]]
                flat = torch.empty(shard.numel, dtype=first.dtype, device=first.device)
                for i, off, n in zip(shard.params, shard.offsets, shard.lengths):
                    p = self._params[i]
                    flat[off:off + n].copy_(p.detach().reshape(-1))
                    p.data = flat[off:off + n].view(p.shape)
                self._flat.append(flat)
        state = getattr(self, "_hook_state", None)
        if state is not None:  # shards the hook kept for buckets that are gone
            sizes = {s.index: s.numel - (s.world - 1) * s.shard for s in self._shards}
            for index in [i for i, t in state.grads.items() if sizes.get(i) != t.numel()]:
                del state.grads[index]
        self._pieces: list[tuple[BucketShard, Piece, torch.Tensor]] = []
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        inner_groups = [dict(g, params=[]) for g in self.param_groups]
        for shard, flat in zip(self._shards, self._flat):
            for piece in shard.pieces:
                run = flat[piece.flat:piece.flat + piece.numel]
                main = run.float() if run.dtype in _WIDENED else run
                self._pieces.append((shard, piece, main))
                inner_groups[group_of[id(self._params[piece.param])]]["params"].append(main)
        # one inner group per group, empty where this rank steps none of its elements
        # (torch's ZeroRedundancyOptimizer keeps them too): hyperparameters pair by index
        self.optim = self._optimizer_class(inner_groups, **self.defaults)
        self._sync_groups(into_inner=False)
        if whole:
            self._load_whole(whole)
        if getattr(self, "_module_buckets", None) is not None:
            self._map_modules()

    def _step_block(self) -> int:
        """The pieces' longest run (0: unblocked): See Note [Stepping in cache-sized
        blocks] in layout.py; blocks for an optimizer that steps CPU tensors one at a
        time (neither foreach nor fused, in any group), unless the one-pass Adam steps
        them (adam_step.py), which blocks its own passes."""
        lists = any(g.get(k) for g in [self.defaults, *self.param_groups]
                    for k in ("foreach", "fused"))
        on_cpu = all(p.device.type == "cpu" for p in self._params)
        if lists or not on_cpu:
            return 0
        if (self._optimizer_class not in adam_step.CLASSES
                or any(p.dtype not in (torch.float32, *_WIDENED) for p in self._params)):
            return shard_layout.STEP_BLOCK
        # the groups as the wrapped optimizer will hold them, its defaults filled in
        groups = self._optimizer_class(
            [dict({k: v for k, v in g.items() if k != "params"}, params=[torch.zeros(0)])
             for g in self.param_groups], **self.defaults).param_groups
        one_pass = adam_step.options_reason(self._optimizer_class, groups) is None
        return 0 if one_pass else shard_layout.STEP_BLOCK

    def _sync_groups(self, into_inner: bool = True) -> None:
        """Hyperparameters (lr from a scheduler...) between the full groups and the wrapped
        optimizer's: self.param_groups is the one users and schedulers change."""
        for inner, outer in zip(self.optim.param_groups, self.param_groups):
            for key, value in (outer if into_inner else inner).items():
                if key != "params":
                    (inner if into_inner else outer)[key] = value

    # ---- the DDP side -----------------------------------------------------------------

    def _attach(self, ddp) -> None:
        ddp.attach_sharder(self)
        # Reduce-scatter where the backend has a real one: NCCL's, and pycomm's (shared
        # memory on one host; across hosts See Note [Hierarchical reduce-scatter and
        # all-gather] in csrc/shm/hier.h). Gloo's is an all-reduce per rank, so on Gloo
        # the bucket is all-reduced and the rank keeps its range.
        reduce_scatter = dist.get_backend(self._comm_group) in ("nccl", "pycomm")
        # the buckets' storage is freed once the hook kept the shard, unless it holds
        # no_sync's fp32 sums between steps (grad_reduce_dtype, Note [main_grad
        # accumulation]): then param.grad is the reduced bucket, as without sharding
        release = ddp.config.grad_reduce_dtype is None
        self._hook_state = HookState(self, reduce_scatter, release)
        # See Note [One rank: nothing to shard]
        self._hooked = self.release_gradients and (
            self.world_size > 1 or ddp.config.grad_reduce_dtype is not None)
        if self._hooked:
            ddp.register_sharding_hook(self._hook_state, reduce_scatter_hook,
                                       reduce_scatter_in_place_hook)
            ddp.reducer.set_release_gradients(release)
            self._hook_state.registered(ddp.reducer)
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
            # it drops param.main_grad's averages (a DDP re-cuts before the next forward,
            # after the step): this step reads them from a copy
            wide = self._ddp.config.grad_reduce_dtype is not None
            saved = {i: g.reshape(-1).clone() for i, g in enumerate(
                map(self._ddp.synced_grad, self._params)) if g is not None} \
                if wide and self._ddp.reducer.should_rebuild_buckets() else None
            state.final = self._ddp.rebuild_buckets_if_due()
            if state.final and saved is not None:
                self._first_grads = saved
        elif not state.final and state.first:
            self._ddp.rebuild_buckets_if_due()
            self._first_grads, state.first, state.final = state.first, {}, True
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
        rebuilt = ddp.rebuild_buckets_if_due()
        self._bind(ddp)
        self._relayout(whole)
        self._attach(ddp)
        if rebuilt:  # See Note [The first step's buckets]: no re-cut is still to come
            self._hook_state.final = True

    # ---- the step ---------------------------------------------------------------------

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
        unused = set(self._ddp.reducer.unused_parameters())
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
            lo, _ = shard.mine
            tail, _ = shard.tail
            start = piece.flat - lo if piece.flat < tail else shard.shard + piece.flat - tail
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
        why = adam_step.reason(self.optim) if not forwarded else "step() was given arguments"
        if why is None:
            adam_step.step(self.optim)
            self.step_kernel = "pycomm one-pass Adam"
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

    def _broadcast_tails(self) -> None:
        """Every bucket's tail from its owner (See Note [Flat shards of a bucket] in
        layout.py), packed: one broadcast per dtype and device."""
        if self.world_size == 1:
            return
        tails: dict[tuple, list[torch.Tensor]] = {}
        for shard, flat in zip(self._shards, self._flat):
            lo, hi = shard.tail
            if hi > lo:
                tails.setdefault((flat.dtype, flat.device), []).append(flat[lo:hi])
        if not tails:
            return
        owner = dist.get_global_rank(self._comm_group, self._shards[0].tail_owner)
        for runs in tails.values():
            packed = torch.cat(runs) if len(runs) > 1 else runs[0].clone()
            dist.broadcast(packed, src=owner, group=self._comm_group)
            if self.rank != self._shards[0].tail_owner:
                torch._foreach_copy_(runs, list(packed.split([r.numel() for r in runs])))

    def _gather(self) -> None:
        """All-gather every bucket's parameters, last bucket first."""
        world, rank = self.world_size, self.rank
        self.gathers.begin_step()
        for shard in reversed(self._shards):
            s = shard.shard
            if world == 1 or s == 0:
                continue
            flat = self._flat[shard.index]
            work = _all_gather(flat[:world * s], flat[rank * s:(rank + 1) * s],
                               group=self._comm_group, async_op=True)
            self._pending[shard.index] = work
            self.gathers.launched(shard.index, work)
        if not (self.overlap_with_ddp and self._ddp is not None):
            self.wait_for_params()

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

    @property
    def grads_in_shards(self) -> bool:
        """Whether the averaged gradients live in this optimizer's shards rather than in
        param.grad (See Note [Two gradient modes]): then the clips of pycomm and of the DDP
        ask it for the norm."""
        return self._ddp is not None and self._hooked

    def covers(self, params: list[torch.Tensor]) -> bool:
        """Whether `params` are all parameters this optimizer shards (or frozen ones)."""
        return all(id(p) in self._index or not p.requires_grad for p in params)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        parameters: Optional[Iterable[torch.Tensor]] = None) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as torch.nn.utils.
        clip_grad_norm_ over the whole model would: each rank's norm partial of the runs it
        owns, one all-reduce, the pieces scaled (Note [Clipping from partials] in
        pycomm/clip.py). Inside the
        DDP's no_sync (local gradients in param.grad, nothing reduced) it clips param.grad
        as pycomm.clip_grad_norm_ does. `parameters` (default: all it shards) restricts the
        norm and the scaling to those, as torch's clip of a subset does. Collective."""
        if self._ddp is None:
            self._adopt_ddp()  # See Note [Wrapped after the optimizer]: before the indices
        chosen = None if parameters is None else {
            self._index[id(p)] for p in parameters if id(p) in self._index}
        if self._ddp is not None and not self._ddp.require_backward_grad_sync:
            local = self._params if chosen is None else [self._params[i] for i in chosen]
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
        if not self.grads_in_shards:
            runs = [p.grad for p in self._all_params if p.grad is not None]
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
        _refuse_sparse(self.param_groups[-1:], len(self.param_groups) - 1)
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class _ZeroJoinHook(JoinHook):
    """A joined rank's shadow of step(), after the DDP's shadow of the backward: that
    reduce-scattered its zero buckets, so this rank kept the others' averaged gradients of
    its range, which it steps and all-gathers as they do (its shard must stay current)."""

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


__all__ = ["ZeroRedundancyOptimizer"]
