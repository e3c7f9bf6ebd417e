"""`pycomm.DistributedDataParallel`: the nn.Module face of the C++ reducer, a drop-in for
torch 2.13's DistributedDataParallel. Puts the pieces of pycomm/ddp/ together and owns
torch's DDP API (no_sync, comm hooks, join, reports). The hot path (hooks, bucket copy,
collectives, finalize) is csrc/reducer/; what it builds from is construction.py's and
args.py's; the collectives around each forward are forward.py's; uneven inputs are
join.py's; what torch.compile sees of the forward is compile.py's; pickling is
pickling.py's."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .. import overlap, registry
from ..config import DDPConfig
from . import construction, pickling
from .args import (
    NOT_GIVEN,
    check_args,
    config_from_args,
    find_tensors,
    release_argument,
    resolve_group,
    torch_release_signature,
)
from .clip import clip_ddp_grad_norm_, synced_grad
from .compat import TorchDDPAttributes, TorchReducer
from .compile import (
    GraphSplit,
    call_module,
    eval_frame_callback,
    mark_skipped_frames,
    module_compiled,
    skipped_frame,
    warn_if_python_reducer,
)
from .delay import DelayedAllReduce
from .finalization import TORCH_HAS_MANUAL_FINALIZATION, ManualFinalization
from .forward import ForwardSync
from .join import DDPJoinHook
from .runtime import Runtime
from .sharding import ShardingSide

# torch's API of the installed release: a later release's methods only where torch has them
_TORCH_RELEASE_API = (ManualFinalization,) if TORCH_HAS_MANUAL_FINALIZATION else ()


class DistributedDataParallel(TorchDDPAttributes, ShardingSide, *_TORCH_RELEASE_API, nn.Module,
                              Joinable):
    """Data parallelism with pycomm's C++ bucketed reducer; torch 2.13's constructor. An
    instance of torch's DistributedDataParallel too: See Note [Virtual subclass of torch's
    DDP] in compat.py, which also holds torch's attributes that libraries read."""

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                 lazy_bucket_allocation=NOT_GIVEN, *, config: Optional[DDPConfig] = None):
        super().__init__()
        Joinable.__init__(self)
        lazy_bucket_allocation = release_argument("lazy_bucket_allocation",
                                                  lazy_bucket_allocation, False)
        check_args(mixed_precision=mixed_precision,
                   delay_all_reduce_named_params=delay_all_reduce_named_params,
                   param_to_hook_all_reduce=param_to_hook_all_reduce,
                   check_reduction=check_reduction)
        self.module = module
        self.config = config_from_args(
            config, bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers,
            init_sync=init_sync, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy, lazy_bucket_allocation=lazy_bucket_allocation)
        self.process_group = resolve_group(process_group, device_mesh)
        # before any other collective: options that differ would desynchronize them
        self.config = construction.agreed_config(self.config, self.process_group)
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
        self._graph_split = GraphSplit()
        warn_if_python_reducer()
        self._named_params = construction.trainable_params(module, self._delayed_names)
        registry.register_ddp(self, [p for _, p in self._named_params])
        self.device, self.device_ids, self.output_device = construction.placement(
            module, self._named_params, device_ids, output_device, self.process_group)
        self._delayed_spec = None if delay_all_reduce_named_params is None else (
            list(delay_all_reduce_named_params), param_to_hook_all_reduce)
        self._delayed = self._make_delayed()
        if self._delayed is not None:
            self._delayed.broadcast()
        if self.config.init_sync:
            # torch: the buffers not with broadcast_buffers=False
            buffers = self._buffers_to_sync() if self.config.init_sync_buffers else []
            construction.verify_and_sync_states(self.process_group, self._params_to_sync(),
                                                buffers)
        self._build_reducer()

    __init__.__signature__ = torch_release_signature(__init__)

    # ---- construction (see construction.py) ------------------------------------------

    def _ignored(self) -> set[str]:
        return construction.ignored(self.module, self._delayed_names)

    def _params_to_sync(self) -> list[tuple[str, nn.Parameter]]:
        return construction.params_to_sync(self.module, self._delayed_names)

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        return construction.buffers_to_sync(self.module, self._delayed_names)

    def _build_reducer(self, manual_finalization: bool = False) -> None:
        """(Re)build the reducer and everything around it, whole (runtime.py). A rebuilt
        reducer keeps the old one's manual finalization (finalization.py)."""
        old = self.__dict__.get("_runtime")
        if old is not None:
            manual_finalization = old.reducer.manual_finalization
        self._runtime = Runtime(self)
        if manual_finalization:
            self._runtime.reducer.set_manual_finalization(True)

    @property
    def reducer(self) -> TorchReducer:
        """The C++ reducer (torch's attribute name); rebuilt with the runtime."""
        return self._runtime.reducer

    @property
    def _sync(self) -> ForwardSync:
        return self._runtime.sync

    def _make_delayed(self) -> Optional[DelayedAllReduce]:
        spec = self._delayed_spec
        return None if spec is None else DelayedAllReduce(*spec, self.process_group, self)

    def _set_main_grads(self) -> None:
        self._sync.set_main_grads()

    # ---- forward (the collectives around it: see forward.py) -------------------------

    # Under torch.compile only the wrapped module's call is traced: dynamo skips this frame
    # (not what it calls: See Note [Frames dynamo sees] in compile.py) and never enters the
    # pre/post work, whose reducer and collective calls would each break the graph and
    # whose state (no_sync, the step) would become guards.
    @skipped_frame
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Whether dynamo compiles what this frame calls (torch.compile(ddp)): read here,
        # where its frame callback is still set, by a C function (no frame of its own).
        compiling = eval_frame_callback() is not None
        inputs, kwargs = self._pre_forward(inputs, kwargs, compiling)
        output = call_module(self, self._graph_split, inputs, kwargs)
        return self._post_forward(output)

    @torch._disable_dynamo
    def _pre_forward(self, inputs: tuple, kwargs: dict,
                     compiling: bool = False) -> tuple[tuple, dict]:
        mark_skipped_frames()
        sharder = self.sharder
        if sharder is not None:  # a ZeroRedundancyOptimizer's pending parameter all-gathers
            sharder.before_module_call(compiling or module_compiled(self.module))
        sync = self._sync
        sync.notify_join(self, self._join_divide_by_initial_world_size)
        if torch.is_grad_enabled():
            sync.rebuild_buckets_if_due()
        join_enabled = self._join_config.enable
        if self.config.broadcast_buffers and self.require_forward_param_sync:
            sync.sync_buffers(authoritative=True, join_enabled=join_enabled)
        if join_enabled:
            sync.requires_sync(this_rank=self.require_backward_grad_sync)
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
        each bucket's norm is computed as its collective completes. See clip.py."""
        return clip_ddp_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def synced_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """`param`'s synchronized gradient, what clip_grad_norm_ scales and an optimizer
        steps: param.grad, or param.main_grad where config.main_grad_only leaves
        param.grad None."""
        return synced_grad(self, param)

    def local_grad_norm(self) -> Optional[torch.Tensor]:
        """With config.local_clip_max_norm: this rank's total gradient norm before it was
        clipped, of the last synchronized backward (a tensor, no host sync); else None."""
        local_clip = self._runtime.local_clip
        return None if local_clip is None else local_clip.total_norm()

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch's protocol: hook(state, dist.GradBucket) -> torch.futures.Future[Tensor]."""
        if not callable(hook):
            raise TypeError(f"communication hook must be callable, got {type(hook).__name__}")
        if self._sync.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        wire = self.wire  # None once a hook is registered
        if wire is not None and not wire.exact:
            raise RuntimeError(f"register_comm_hook: this DDP sends its gradients across hosts "
                               f"as DDPConfig(wire={wire.name!r}) says, and a comm "
                               f"hook would decide that itself: use one or the other "
                               f"(wire='fp32' with a hook)")
        self.reducer.register_comm_hook(state, hook)
        self._sync.comm_hook = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        self.register_comm_hook(self.gradient_group, hooks[comm_hook_type])

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

    # ---- join (uneven inputs; see join.py) -------------------------------------------

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
        self._join_divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size",
                                                             True)
        return DDPJoinHook(lambda: self._sync, self)

    @property
    def gradient_group(self) -> dist.ProcessGroup:
        """The group gradients are all-reduced on: `process_group` itself, or the "pycomm"
        shared-memory group made over the same ranks (see pycomm.shm.stats)."""
        return self._sync.gradient_group

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # ---- pickling (torch.save of the wrapper; see pickling.py) -----------------------

    def __getstate__(self) -> dict:
        return pickling.pickled_state(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        state, split, manual_finalization = pickling.unpickled_state(state)
        self.process_group = dist.distributed_c10d._get_default_group()
        super().__setstate__(state)
        self._graph_split = split
        # The delayed all-reduce's hook and buffer are not picklable: rebuilt from the
        # pickled (names, parameters, hook parameter), the same objects as the module's.
        # torch 2.13's own DDP silently stops reducing them after torch.load (its
        # _delayed_all_reduce_hook is a tensor hook, which Parameter pickling drops).
        self._delayed = self._make_delayed()
        self._build_reducer(manual_finalization)
