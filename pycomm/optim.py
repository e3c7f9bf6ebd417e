"""torch's Adam and AdamW, stepped in one pass over memory with torch's for-loop bits.

`pycomm.optim.AdamW(params, ...)` and `pycomm.optim.Adam(params, ...)` take torch's
arguments and are torch's classes (subclasses: isinstance, state_dict, param groups, LR
schedulers, hooks, GradScaler and closures as torch's). `pycomm.optim.one_pass(opt)`
turns an AdamW or Adam already built (by Lightning's configure_optimizers, Accelerate's
prepare, the HF Trainer) into one. With or without pycomm's DDP.

Each step() runs the one-pass kernel (pycomm::adam_step_: Note [Adam in one pass, with
torch's bits] in csrc/grad/adam_cpu.cpp) where it gives the for-loop's bits (Note
[Probing the one-pass Adam] in pycomm/adam_step.py): float32 on CPU, no amsgrad,
maximize, capturable, differentiable, foreach or fused, float hyperparameters. Elsewhere
torch's own step runs, so the result is always torch's; the first such step warns once,
naming why, and `one_pass_reason()` and `step_kernel` say which ran.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from . import adam_step
from .adam_step import ONE_PASS_STEP

__all__ = ["Adam", "AdamW", "one_pass"]


class _OnePass:
    """The step of Adam and AdamW below; `one_pass_of` is the torch class stepped as."""

    one_pass_of: type

    def one_pass_reason(self) -> Optional[str]:
        """Why the next step() runs torch's own step rather than the one-pass kernel (None:
        it runs the kernel)."""
        return adam_step.step_reason(self, self.one_pass_of)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """torch's step: the closure (if any) runs first with gradients enabled and its
        loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        why = adam_step.try_step(self, self.one_pass_of)  # one_pass_reason(), remembered
        if why is None:
            self.step_kernel = ONE_PASS_STEP
            return loss
        if not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn(f"pycomm.optim.{type(self).__name__} runs torch's own "
                          f"{self.one_pass_of.__name__} step (the same result, not the "
                          f"one-pass kernel): {why}", stacklevel=2)
        adam_step.hookless_step(self.one_pass_of)(self)
        self.step_kernel = f"{self.one_pass_of.__name__}.step ({why})"
        return loss


class AdamW(_OnePass, torch.optim.AdamW):
    """torch.optim.AdamW, stepped in one pass with its bits (module docstring)."""

    one_pass_of = torch.optim.AdamW

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_kernel: Optional[str] = None  # what the last step ran


class Adam(_OnePass, torch.optim.Adam):
    """torch.optim.Adam, stepped in one pass with its bits (module docstring)."""

    one_pass_of = torch.optim.Adam

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_kernel: Optional[str] = None


_ONE_PASS = {torch.optim.AdamW: AdamW, torch.optim.Adam: Adam}


def one_pass(optimizer: Optimizer) -> Optimizer:
    """`optimizer` (torch's AdamW or Adam, built) made to step in one pass, in place: its
    class becomes pycomm.optim.AdamW / Adam (still an instance of torch's), its state,
    groups and hooks kept. Returns it. Raises TypeError for any other class, a subclass
    of torch's included (it may step otherwise)."""
    cls = type(optimizer)
    if cls in _ONE_PASS.values():
        return optimizer
    if cls not in _ONE_PASS:
        raise TypeError(f"pycomm.optim.one_pass: takes torch.optim.AdamW or torch.optim.Adam "
                        f"(exactly, built), got {cls.__module__}.{cls.__qualname__}")
    if "step" in vars(optimizer):
        raise TypeError("pycomm.optim.one_pass: this optimizer's step() is already wrapped "
                        "(an LR scheduler was built on it): call one_pass() before building "
                        "the scheduler")
    optimizer.__class__ = _ONE_PASS[cls]
    optimizer._patch_step_function()  # torch's hooks around the new class's step
    optimizer.step_kernel = None
    return optimizer
