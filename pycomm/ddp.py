"""`pycomm.DistributedDataParallel`: the nn.Module face of the C++ reducer, a drop-in for
torch 2.13's DistributedDataParallel. Owns construction checks, the per-forward protocol
(bucket rebuild, buffer sync, arming the reducer), no_sync, comm hooks and pickling. The
hot path (hooks, bucket copy, collectives, finalize) is csrc/reducer/; uneven inputs are
ddp_join.py's; argument wiring is ddp_args.py's; what torch.compile sees of the forward is
ddp_compile.py's."""

from __future__ import annotations

import copy
import itertools
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import _C, overlap
from .clip import attach_local_clip
from .config import BROADCAST_BUCKET_BYTES, DDPConfig
from .ddp_args import check_args, config_from_args, find_tensors, gradient_group, resolve_group
from .ddp_compat import TorchDDPAttributes, TorchReducer
from .ddp_compile import call_module, mark_skipped_frames, skipped_frame, warn_if_python_reducer
from .ddp_delay import DelayedAllReduce
from .ddp_join import DDPJoinHook, notify_join
from .objects import all_gather_object
from .shm import ranks_by_host


class DistributedDataParallel(TorchDDPAttributes, nn.Module, Joinable):
    """Data parallelism with pycomm's C++ bucketed reducer; torch 2.13's constructor. An
    instance of torch's DistributedDataParallel too: See Note [Virtual subclass of torch's
    DDP] in ddp_compat.py, which also holds torch's attributes that libraries read."""

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                 *, config: Optional[DDPConfig] = None):
        args = dict(locals())
        super().__init__()
        Joinable.__init__(self)
        check_args(args)
        self.module = module
        self.config = config_from_args(config, args)
        self.process_group = resolve_group(process_group, device_mesh)
        if device_mesh is not None and device_mesh._get_root_mesh() != device_mesh:
            # A data-parallel slice of a larger mesh: torch turns tensor-parallel (DTensor)
            # parameters into local tensors first; pycomm does the same, with torch's helper.
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
            _pre_dp_module_transform(module)
        self._delayed_names = {n for n, _ in (delay_all_reduce_named_params or ())}
        self.dim = dim
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._join_divide_by_initial_world_size = True
        self._split_refused = False  # See Note [Refused split] in ddp_compile.py
        warn_if_python_reducer()
        self._named_params = self._trainable_params()
        self._check_devices(device_ids, output_device)
        self._delayed_spec = None if delay_all_reduce_named_params is None else (
            list(delay_all_reduce_named_params), param_to_hook_all_reduce)
        self._delayed = self._make_delayed()
        if self._delayed is not None:
            self._delayed.broadcast(self.process_group)
        if self.config.init_sync:
            self._verify_and_sync_states()
        self._build_reducer()

    # ---- construction ----------------------------------------------------------------

    def _ignored(self) -> set[str]:
        """Names the reducer and the state broadcasts leave alone: the module's ignored
        ones and the delayed ones (see ddp_delay.py), as torch's parameters_to_ignore."""
        ignored = set(getattr(self.module, "_ddp_params_and_buffers_to_ignore", ()))
        return ignored | getattr(self, "_delayed_names", set())

    def _trainable_params(self) -> list[tuple[str, nn.Parameter]]:
        ignored = self._ignored()
        named = [(n, p) for n, p in self.module.named_parameters()
                 if p.requires_grad and n not in ignored]
        if not named and self._delayed_names:
            raise NotImplementedError("delay_all_reduce_named_params covering every trainable "
                                      "parameter (torch then runs without a reducer) is not "
                                      "implemented by pycomm")
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't "
                               "have any parameter that requires a gradient.")
        for name, sub in self.module.named_modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
                raise NotImplementedError(f"sparse gradients ({name or 'module'} has "
                                          "sparse=True) are not supported by pycomm DDP")
        return named

    def _check_devices(self, device_ids, output_device) -> None:
        devices = {p.device for _, p in self._named_params}
        if len(devices) > 1 and device_ids is not None:
            raise ValueError(f"DistributedDataParallel device_ids and output_device arguments "
                             f"only work with single-device modules, but parameters are on "
                             f"{sorted(map(str, devices))}; pass device_ids=None")
        device = next(iter(devices))
        if device.type == "cpu" and device_ids is not None:
            raise ValueError(f"device_ids must be None for a CPU module, got {device_ids}")
        for name, sub in self.module.named_modules():
            if isinstance(sub, nn.SyncBatchNorm) and device.type == "cpu":
                raise ValueError(f"SyncBatchNorm layers only work with GPU modules ({name})")
        backend = dist.get_backend(self.process_group)
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"process group backend 'nccl' cannot reduce gradients of "
                             f"parameters on {device}; use a gloo group for CPU modules")
        self.device = device
        self.device_ids = None if device_ids is None else [
            d.index if isinstance(d, torch.device) else int(d) for d in device_ids]
        self.output_device = output_device if output_device is not None else (
            self.device_ids[0] if self.device_ids else None)

    def _verify_and_sync_states(self) -> None:
        meta = [(n, tuple(p.shape), str(p.dtype)) for n, p in self._params_to_sync()]
        gathered = all_gather_object(meta, group=self.process_group)
        for rank, other in enumerate(gathered):
            if other == gathered[0]:
                continue
            for a, b in itertools.zip_longest(gathered[0], other):
                if a != b:
                    raise RuntimeError(f"DDP expects the same parameters on every rank: rank 0 "
                                       f"has {a}, rank {rank} has {b} (name, shape, dtype)")
        states = [p.detach() for _, p in self._params_to_sync()]
        if self.config.init_sync_buffers:  # torch: not with broadcast_buffers=False
            states += self._buffers_to_sync()
        if states:
            dist._broadcast_coalesced(self.process_group, states, BROADCAST_BUCKET_BYTES, 0)

    def _params_to_sync(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters (trainable or not) kept identical across ranks: all but the ignored."""
        ignored = self._ignored()
        return [(n, p) for n, p in self.module.named_parameters() if n not in ignored]

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        ignored = self._ignored()
        return [b.detach() for n, b in self.module.named_buffers() if n not in ignored]

    def _build_reducer(self) -> None:
        params = [p for _, p in self._named_params]
        names = [n for n, _ in self._named_params]
        # Before any gradient was seen: buckets cut in reverse registration order (so
        # overlap starts at step 1, unlike torch 2.13's single first-step bucket), each
        # laid out in registration order as torch lays out its buckets (so a one-bucket
        # layout is byte-identical to torch's and reductions match bitwise).
        order = list(reversed(range(len(params))))
        assignment = [sorted(b) for b in
                      _C.assign_buckets(params, order, self.config.bucket_byte_limits())]
        self._gradient_pg = gradient_group(self.process_group, self.config)
        c = self.config
        self.reducer = TorchReducer(self, params, names, assignment, self._gradient_pg,
                                    c.gradient_as_bucket_view, c.find_unused_parameters,
                                    c.static_graph, c.record_timeline, c.timeline_steps,
                                    c.grad_reduce_dtype,
                                    skip_all_reduce_unused_params=c.skip_all_reduce_unused_params,
                                    batched_grad_copy=c.batched_grad_copy,
                                    inline_collectives=c.inline_collectives,
                                    main_grad_only=c.main_grad_only,
                                    streaming_copies=c.streaming_copies,
                                    shared_buckets=c.shared_memory_buckets)
        # Whose address a Gloo error names, where the group spans hosts (the flat group or
        # the hierarchical one's Gloo parts; [] on one host).
        self.reducer.set_peer_hosts(ranks_by_host(self.process_group))
        self._comm_hook: Optional[tuple[Any, Callable]] = None
        self._set_main_grads()
        self._local_clip = attach_local_clip(self.reducer, c)

    def _make_delayed(self) -> Optional[DelayedAllReduce]:
        spec = getattr(self, "_delayed_spec", None)
        return None if spec is None else DelayedAllReduce(self, *spec)

    def _set_main_grads(self) -> None:
        if self.config.grad_reduce_dtype is None:
            return
        for i, (_, p) in enumerate(self._named_params):
            view = self.reducer.grad_view(i)
            if view.dtype != p.dtype:
                p.main_grad = view

    # ---- forward ---------------------------------------------------------------------

    # Under torch.compile only the wrapped module's call is traced: dynamo skips this frame
    # (not what it calls: See Note [Frames dynamo sees] in ddp_compile.py) and never
    # enters the pre/post work, whose reducer and collective calls would each break the
    # graph and whose state (no_sync, the step) would become guards.
    @skipped_frame
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = call_module(self, inputs, kwargs)
        return self._post_forward(output)

    @torch._disable_dynamo
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mark_skipped_frames()
        notify_join(self)
        if torch.is_grad_enabled():
            self._rebuild_buckets_if_due()
        if self.config.broadcast_buffers and self.require_forward_param_sync:
            self._sync_buffers(authoritative=True)
        if self._join_config.enable:
            self._join_requires_sync(joined=False)
        if self.device_ids:
            from torch.distributed.utils import _to_kwargs
            target = torch.device(self.device.type, self.device_ids[0])
            moved, moved_kwargs = _to_kwargs(inputs, kwargs, target, False)
            inputs, kwargs = moved[0], moved_kwargs[0]
        return inputs, kwargs

    @torch._disable_dynamo
    def _post_forward(self, output: Any) -> Any:
        # torch's _post_forward, read after the module ran (Lightning's manual optimization
        # toggles require_backward_grad_sync inside it). Buffers are synchronized before the
        # next forward only if this one was a synchronizing one (so not after a no_sync
        # micro-batch or a torch.no_grad() forward in train mode).
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = grad_sync
        if grad_sync:
            note = self.reducer.prepare_for_backward(find_tensors(output))
        else:
            note = self.reducer.prepare_no_sync()
        if note:  # see Note [Abandoned step] in csrc/reducer/finalize.cpp
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        if self._delayed is not None:
            self._delayed.after_forward(grad_sync)
        return output

    def _rebuild_buckets_if_due(self) -> bool:
        """Once, after the first synchronized step: buckets re-cut in rank 0's observed
        gradient-ready order, a burst of gradients from one autograd node split across
        buckets only where each part fills one (See Note [Gradient groups] in
        csrc/reducer/groups.cpp); broadcast, so every rank gets the same layout."""
        if not self.reducer.should_rebuild_buckets():
            return False
        seen = torch.tensor([self.reducer.ready_order(), self.reducer.ready_groups()],
                            dtype=torch.int64, device=self.device)
        dist.broadcast(seen, dist.get_global_rank(self._gradient_pg, 0), group=self._gradient_pg)
        order, groups = seen.cpu().tolist()
        params = [p for _, p in self._named_params]
        assignment = _C.assign_buckets(params, order, self.config.bucket_byte_limits(), groups)
        self.reducer.rebuild_buckets(assignment)
        self._set_main_grads()
        return True

    def _sync_buffers(self, authoritative: bool) -> None:
        buffers = self._buffers_to_sync()
        if not buffers or dist.get_world_size(self.process_group) == 1:
            return
        src = self._find_common_rank(authoritative) if self._join_config.enable else 0
        # As torch: the broadcast does not bump the buffers' version counters, so a graph
        # that saved a buffer for backward is not invalidated by it.
        with torch.no_grad(), ExitStack() as keep:
            for b in buffers:  # one tensor each: torch < 2.6 takes no tuple here
                keep.enter_context(torch.autograd._unsafe_preserve_version_counter(b))
            dist._broadcast_coalesced(self.process_group, buffers, BROADCAST_BUCKET_BYTES,
                                      src)

    def _find_common_rank(self, condition: bool) -> int:
        """The highest rank for which `condition` holds (torch's _find_common_rank)."""
        rank = dist.get_rank(self.process_group)
        t = torch.tensor([rank if condition else -1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        common = int(t.item())
        if common < 0:
            raise RuntimeError("join: no rank satisfied the condition (internal error)")
        return common

    def _join_requires_sync(self, joined: bool) -> bool:
        flag = torch.ones(1, device=self.device) if (not joined and
                                                    self.require_backward_grad_sync) \
            else torch.zeros(1, device=self.device)
        dist.all_reduce(flag, group=self.process_group)
        return bool(flag.item() != 0)

    # ---- torch's DDP API -------------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next synchronized backward reduces them."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the synchronized gradients, as torch.nn.utils.clip_grad_norm_ on them would;
        each bucket's norm is computed as its collective completes. See pycomm/clip.py."""
        from .clip import clip_ddp_grad_norm_
        return clip_ddp_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def local_grad_norm(self) -> Optional[torch.Tensor]:
        """With config.local_clip_max_norm: this rank's total gradient norm before it was
        clipped, of the last synchronized backward (a tensor, no host sync); else None."""
        return None if self._local_clip is None else self._local_clip.total_norm()

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch's protocol: hook(state, dist.GradBucket) -> torch.futures.Future[Tensor]."""
        if not callable(hook):
            raise TypeError(f"communication hook must be callable, got {type(hook).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        self.reducer.register_comm_hook(state, hook)
        self._comm_hook = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        self.register_comm_hook(self._gradient_pg, hooks[comm_hook_type])

    def timelines(self, n: int = 1) -> list[dict]:
        """The reducer's last `n` step timelines (see Note [Timeline]), most recent last."""
        return self.reducer.timelines(n)

    # ---- overlap reports (pycomm.overlap) --------------------------------------------

    def step_reports(self, n: int = 1) -> list[overlap.StepReport]:
        """Overlap reports of the last `n` synchronized steps, most recent last: backward,
        communication, exposed communication, overlap and one row per bucket."""
        return overlap.step_reports(self.timelines(n), self.config.record_timeline)

    def last_step_report(self) -> Optional[overlap.StepReport]:
        """The last synchronized step's overlap report (None before the first)."""
        reports = self.step_reports(1)
        return reports[-1] if reports else None

    def export_chrome_trace(self, path: str, all_ranks: bool = False,
                            align: str = "clock") -> Optional[str]:
        """Write the recorded steps as a Chrome/Perfetto trace; with all_ranks=True every
        rank must call it and rank 0 writes all ranks' steps. Returns the path written.
        Ranks on several hosts do not share a clock: pass align="step" (see
        pycomm.overlap.chrome_trace)."""
        return overlap.write_chrome_trace(path, self.step_reports(self.config.timeline_steps),
                                          all_ranks=all_ranks, group=self.process_group,
                                          align=align)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names) -> None:
        module._ddp_params_and_buffers_to_ignore = list(names)

    # ---- join (uneven inputs; see ddp_join.py) ---------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        for refused, name in ((self.config.skip_all_reduce_unused_params,
                               "skip_all_reduce_unused_params"),
                              (self._delayed is not None, "delay_all_reduce_named_params")):
            if refused:  # torch's join hook does not shadow these either: it would hang
                raise NotImplementedError(f"join() with {name}: a joined rank cannot know "
                                          f"which collectives the others run for it")
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def gradient_group(self) -> dist.ProcessGroup:
        """The group gradients are all-reduced on: `process_group` itself, or the "pycomm"
        shared-memory group made over the same ranks (see pycomm.shm.stats)."""
        return self._gradient_pg

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # ---- pickling (torch.save of the wrapper) ----------------------------------------

    def __getstate__(self) -> dict:
        attrs = copy.copy(self.__dict__)
        for key in ("process_group", "_gradient_pg", "reducer", "_comm_hook", "_bucket_norms",
                    "_delayed", "_local_clip"):
            attrs.pop(key, None)
        return attrs

    def __setstate__(self, state: dict) -> None:
        self.process_group = dist.distributed_c10d._get_default_group()
        state.setdefault("_split_refused", False)  # pickled by a pycomm without it
        super().__setstate__(state)
        # The delayed all-reduce's hook and buffer are not picklable: rebuilt from the
        # pickled (names, parameters, hook parameter), the same objects as the module's.
        # torch 2.13's own DDP silently stops reducing them after torch.load (its
        # _delayed_all_reduce_hook is a tensor hook, which Parameter pickling drops).
        self._delayed = self._make_delayed()
        self._build_reducer()
