"""pycomm's DistributedDataParallel under Lightning (lightning.pytorch, 2.6):
`Trainer(strategy=pycomm.lightning.DDPStrategy(...))`, or `Trainer(strategy="pycomm_ddp")`
once this module is imported. Imports Lightning, so `import pycomm` does not import this
module; `pycomm.lightning` (or `import pycomm.lightning`) does.

The strategy is Lightning's DDPStrategy with two changes: configure_ddp wraps the module
in pycomm's DDP (its keyword arguments, `config=pycomm.DDPConfig(...)` included, go to
pycomm's constructor as Lightning passes them to torch's), and gradient clipping by norm
(`Trainer(gradient_clip_val=...)`) runs pycomm's fused clip_grad_norm_. Everything else
is Lightning's: `accumulate_grad_batches` runs the non-final micro-batches under
`no_sync()`, checkpoints hold the LightningModule's state dict (no `module.` prefix).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Union

import torch

try:
    from lightning.pytorch import LightningModule
except ModuleNotFoundError as missing:
    raise ModuleNotFoundError(
        f"pycomm.lightning needs Lightning ({missing.name} is not installed): "
        "pip install lightning, or pycomm's `integrations` extra "
        "(pip install --no-build-isolation -e \".[integrations]\" from a clone)",
        name=missing.name) from missing
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.strategies import StrategyRegistry
from torch.optim import Optimizer

from .ddp import DistributedDataParallel
from .patching import clip_grad_norm_ as _fused_or_torch_clip_grad_norm_

__all__ = ["DDPStrategy"]

_REGISTERED = (("pycomm_ddp", "popen"), ("pycomm_ddp_spawn", "spawn"),
               ("pycomm_ddp_fork", "fork"), ("pycomm_ddp_notebook", "fork"))


class FusedNormClip:
    """A precision plugin's clip_grad_by_norm through pycomm's fused clip_grad_norm_ (torch's
    for gradients it does not take, e.g. DTensors). Set on the plugin instance rather than
    by subclassing, so every precision plugin (32, 16/bf16-mixed, 16/bf16-true, 64) keeps
    its class and its own unscaling before clipping; picklable for ddp_spawn."""

    def __init__(self, plugin: Precision):
        self.plugin = plugin

    def __call__(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        _fused_or_torch_clip_grad_norm_(list(self.plugin.main_params(optimizer)), clip_val)


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's DDPStrategy with pycomm's DistributedDataParallel."""

    strategy_name = "pycomm_ddp"

    @property
    def precision_plugin(self) -> Precision:
        return _LightningDDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Only plugins that clip with Precision's own method: one that overrides it (FSDP's
        # refuses, DeepSpeed's delegates) keeps its own.
        if plugin is not None and type(plugin).clip_grad_by_norm is Precision.clip_grad_by_norm:
            plugin.clip_grad_by_norm = FusedNormClip(plugin)
        _LightningDDPStrategy.precision_plugin.fset(self, plugin)

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        # As Lightning's: construct on a side stream on CUDA.
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DistributedDataParallel(module=model, device_ids=device_ids,
                                           **self._ddp_kwargs)

    def configure_ddp(self) -> None:
        assert isinstance(self.model, LightningModule)
        self.model = self._setup_model(self.model)
        self._register_ddp_hooks()

    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (torch's reducer ran them only there
        # once); pycomm's reducer runs them on every device.
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook,
                                ddp_comm_wrapper=self._ddp_comm_wrapper)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in _REGISTERED:
            strategy_registry.register(
                name, cls, description=f"pycomm's DDP with start_method '{start_method}'",
                start_method=start_method)


DDPStrategy.register_strategies(StrategyRegistry)
