"""Typed Python wrappers over torch.ops.pycomm.* and their fake (meta) kernels."""

import torch

from . import _C  # noqa: F401  (the schemas and kernels live in the extension)


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat contiguous floating tensor, as a 0-d tensor on x's device.

    Low-precision inputs (float16, bfloat16) accumulate and return in float32.
    """
    return torch.ops.pycomm.sum_squares.default(x)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@torch.library.register_fake("pycomm::sum_squares")
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=_opmath(x.dtype))
