"""What every test needing a CUDA device shares: why it cannot run here, and the skip.

A GPU test module calls `require()` at import: without a device (or without pycomm's CUDA
build) the module is skipped with the reason, so `python -m pytest` passes on a CPU-only
machine. With PYCOMM_REQUIRE_CUDA=1 (tools/gpu_check.py sets it on the GPU machine) the
same reason fails the run instead: there a skipped GPU test is a broken build, not a
missing device.
"""

from __future__ import annotations

import os

import pytest
import torch

import pycomm


def missing(devices: int = 1) -> str | None:
    """Why `devices` CUDA devices and pycomm's CUDA kernels cannot be used here, or None."""
    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__} built for CUDA {torch.version.cuda})"
    if torch.cuda.device_count() < devices:
        return f"needs {devices} CUDA devices, found {torch.cuda.device_count()}"
    if not pycomm._C.cuda:
        return ("pycomm._C was built without its CUDA kernels: rebuild with PYCOMM_CUDA=1 "
                "python setup.py build_ext --inplace")
    return None


def require(devices: int = 1) -> None:
    """Skip the calling test module (fail it under PYCOMM_REQUIRE_CUDA=1) without CUDA."""
    reason = missing(devices)
    if reason is None:
        return
    if os.environ.get("PYCOMM_REQUIRE_CUDA") == "1":
        pytest.fail(f"PYCOMM_REQUIRE_CUDA=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
