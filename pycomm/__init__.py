"""pycomm: gradient communication for PyTorch data-parallel training."""

import torch  # noqa: F401  (loads libtorch before the extension that links to it)

from . import _C  # noqa: F401  (registers torch.ops.pycomm.*)
from ._version import __version__
from .clip import clip_grad_norm_
from .config import DDPConfig
from .ddp import DistributedDataParallel
from .ops import sum_squares
from .shm import register as _register_shm_backend

_register_shm_backend()

__all__ = ["DDPConfig", "DistributedDataParallel", "__version__", "clip_grad_norm_",
           "sum_squares"]
