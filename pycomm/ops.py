"""Typed Python wrappers over torch.ops.pycomm.* and their fake (meta) kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _C  # noqa: F401  (the schemas and kernels live in the extension)


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat contiguous floating tensor, as a 0-d tensor on x's device.

    Low-precision inputs (float16, bfloat16) accumulate and return in float32.
    """
    return torch.ops.pycomm.sum_squares.default(x)


def norm_partial(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm partial of all elements of `tensors` (one device, any floating dtypes).

    Returns a tensor ``[acc, nonfinite]`` on the tensors' device, float64 when any input is
    float64, else float32: ``acc`` is ``sum |x|^p`` (``max |x|`` for ``p = inf``), and
    ``nonfinite`` is 1 when an element is inf or nan, else 0. Partials of disjoint sets
    merge by ``+`` (``max`` for inf), so buckets and ranks combine them before
    :func:`clip_coef` finishes the norm. One pass over memory, no host sync.
    """
    return torch.ops.pycomm.norm_partial.default(list(tensors), float(norm_type))


def clip_coef(partial: torch.Tensor, norm_type: float, max_norm: float,
              norm_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(total_norm, coef) from a merged partial, on its device, without a host sync.

    ``total_norm`` is the finished norm in ``norm_dtype`` (torch's dtype for that norm);
    ``coef`` is ``min(max_norm / (total_norm + 1e-6), 1)`` rounded like torch computes it
    in ``norm_dtype``, stored in that dtype's opmath type (float32 for half/bfloat16).
    """
    return torch.ops.pycomm.clip_coef.default(partial, float(norm_type), float(max_norm),
                                              norm_dtype)


def scale_(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by the one-element tensor `factor`.

    When ``factor`` is 1 nothing is touched: on CPU the value is read first; on CUDA the
    kernel reads it on the device and returns at once (no host sync either way).
    """
    torch.ops.pycomm.scale_.default(list(tensors), factor)


def accumulate_(acc: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                scale: float = 1.0) -> None:
    """``acc[i] += scale * grads[i]`` for every pair, computed in opmath.

    ``acc[i]`` has ``grads[i]``'s dtype, or float32 for a float16/bfloat16 gradient (the
    fp32 main-gradient buffer of a low-precision model).
    """
    torch.ops.pycomm.accumulate_.default(list(acc), list(grads), float(scale))


def clip_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradient tensors themselves (not parameters) in place; returns the total norm.

    norm_partial per device, clip_coef, scale_ per device, in one call from Python. The
    user-facing version, taking parameters like torch's, is :func:`pycomm.clip_grad_norm_`.
    """
    return torch.ops.pycomm.clip_grad_norm_.default(list(grads), float(max_norm),
                                                    float(norm_type), bool(error_if_nonfinite))


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@torch.library.register_fake("pycomm::sum_squares")
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=_opmath(x.dtype))


@torch.library.register_fake("pycomm::norm_partial")
def _(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    torch._check(len(tensors) > 0, lambda: "norm_partial: tensors must not be empty")
    wide = any(t.dtype == torch.float64 for t in tensors)
    return tensors[0].new_empty((2,), dtype=torch.float64 if wide else torch.float32)


@torch.library.register_fake("pycomm::clip_coef")
def _(partial: torch.Tensor, norm_type: float, max_norm: float,
      norm_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return partial.new_empty((), dtype=norm_dtype), partial.new_empty((), dtype=_opmath(norm_dtype))


@torch.library.register_fake("pycomm::scale_")
def _(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    return None


@torch.library.register_fake("pycomm::accumulate_")
def _(acc: list[torch.Tensor], grads: list[torch.Tensor], scale: float) -> None:
    return None


@torch.library.register_fake("pycomm::adam_step_")
def _(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], hyper: torch.Tensor) -> None:
    return None


@torch.library.register_fake("pycomm::clip_grad_norm_")
def _(grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
      error_if_nonfinite: bool = False) -> torch.Tensor:
    torch._check(len(grads) > 0, lambda: "clip_grad_norm_: grads must not be empty")
    dtype = grads[0].dtype
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    return grads[0].new_empty((), dtype=dtype)
