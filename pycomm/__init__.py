"""pycomm: gradient communication for PyTorch data-parallel training."""

import importlib

import torch  # noqa: F401  (loads libtorch before the extension that links to it)

from . import (
    _C,  # noqa: F401  (registers torch.ops.pycomm.*)
    optim,
)
from ._C import Wire, WireDtype
from ._version import __version__
from .clip import clip_grad_norm_
from .config import DDPConfig
from .ddp import DistributedDataParallel
from .patching import Patch, patch
from .shm import register as _register_shm_backend
from .zero import ShardedGradScaler, ZeroRedundancyOptimizer

_register_shm_backend()

__all__ = ["DDPConfig", "DistributedDataParallel", "Patch", "ShardedGradScaler", "Wire",
           "WireDtype", "ZeroRedundancyOptimizer", "__version__", "clip_grad_norm_", "optim",
           "patch"]

_LAZY_SUBMODULES = ("lightning",)  # import their library: only on first use


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
