"""pycomm: gradient communication for PyTorch data-parallel training."""

import torch  # noqa: F401  (loads libtorch before the extension that links to it)

from . import _C  # noqa: F401  (registers torch.ops.pycomm.*)
from ._version import __version__
from .config import DDPConfig
from .ddp import DistributedDataParallel
from .ops import sum_squares

__all__ = ["DDPConfig", "DistributedDataParallel", "__version__", "sum_squares"]
