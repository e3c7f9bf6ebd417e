"""Finishing a clip from a merged norm partial (See Note [Clipping from partials] in
pycomm/clip.py), shared by the clip of plain gradients and that of DTensor gradients
(pycomm/fsdp/clip.py)."""

from __future__ import annotations

import torch

from . import ops


def finish_norm(partial: torch.Tensor, max_norm: float, norm_type: float,
                error_if_nonfinite: bool,
                norm_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(total norm in `norm_dtype`, clip coefficient) of the merged norm `partial`, with
    torch's refusal of a non-finite norm when `error_if_nonfinite`."""
    total, coef = ops.clip_coef(partial, norm_type, max_norm, norm_dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total, coef
