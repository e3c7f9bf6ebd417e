"""`pycomm.patch()`: torch's DistributedDataParallel (and, optionally, clip_grad_norm_)
names point at pycomm's, so libraries that construct torch's DDP build pycomm's instead;
the returned Patch puts torch's back (`undo()`, or leaving a `with` block).

Which names are read when: Accelerate (so the HF Trainer) looks up
torch.nn.parallel.DistributedDataParallel and torch.nn.utils.clip_grad_norm_ each time it
wraps a model or clips, so patch() anywhere before `accelerator.prepare(...)` /
`trainer.train()` is enough. Lightning binds `DistributedDataParallel` when
lightning.pytorch (or lightning.fabric) is imported: patch() must run before that import,
else Lightning keeps constructing torch's (patch() warns). pycomm.lightning.DDPStrategy
needs no patching at all. isinstance checks against torch's class hold either way (See
Note [Virtual subclass of torch's DDP] in ddp/compat.py).
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any, Optional

import torch
import torch.nn.parallel
import torch.nn.parallel.distributed
import torch.nn.utils
import torch.nn.utils.clip_grad

from .clip import clip_grad_norm_ as _fused_clip_grad_norm_
from .ddp import DistributedDataParallel
from .ddp.compat import TORCH_DDP

TORCH_CLIP_GRAD_NORM_ = torch.nn.utils.clip_grad.clip_grad_norm_
"""torch's own clip_grad_norm_, whatever pycomm.patch() later binds to its names."""

_DDP_NAMES = ((torch.nn.parallel, "DistributedDataParallel"),
              (torch.nn.parallel.distributed, "DistributedDataParallel"))
_CLIP_NAMES = ((torch.nn.utils, "clip_grad_norm_"),
               (torch.nn.utils.clip_grad, "clip_grad_norm_"))
# Modules that bind torch's DDP class at their import (`from torch.nn.parallel.distributed
# import DistributedDataParallel`) and construct it under that name.
_EARLY_BINDERS = ("lightning.pytorch.strategies.ddp", "lightning.fabric.strategies.ddp",
                  "pytorch_lightning.strategies.ddp", "lightning_fabric.strategies.ddp")


def _fused_handles(grads: list[torch.Tensor], norm_type: float) -> bool:
    """Whether pycomm's fused clip takes these gradients: dense floating-point tensors on
    CPU or CUDA, all plain or all DTensors (FSDP2, replicate: pycomm/fsdp/clip.py; no other
    subclass), and an order > 0 (torch also takes 0 and negative orders)."""
    if not norm_type > 0:
        return False
    if not grads or type(grads[0]) is torch.Tensor:
        return all(type(g) is torch.Tensor and _plain_dense(g) for g in grads)
    from torch.distributed.tensor import DTensor
    return all(type(g) is DTensor and _plain_dense(g._local_tensor) for g in grads)


def _plain_dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.is_floating_point() and t.device.type in ("cpu",
                                                                                     "cuda")


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ while patched: pycomm's fused clip_grad_norm_, or
    torch's own for gradients the fused one does not take (see _fused_handles)."""
    is_generator = isinstance(parameters, types.GeneratorType)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    clip = (_fused_clip_grad_norm_ if _fused_handles(grads, float(norm_type))
            else TORCH_CLIP_GRAD_NORM_)
    # A generator is handed on as one, so that an empty one warns as torch's does.
    return clip((p for p in params) if is_generator else params, max_norm, norm_type,
                error_if_nonfinite, foreach)


class Patch:
    """What one patch() replaced. undo() (or the end of a `with` block) puts back what was
    there before it; nested patches undo in reverse order."""

    def __init__(self, replaced: list[tuple[types.ModuleType, str, Any]]):
        self._replaced = replaced

    def undo(self) -> None:
        for module, name, old in reversed(self._replaced):
            setattr(module, name, old)
        self._replaced = []

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def _warn_early_binders() -> None:
    early = [name for name in _EARLY_BINDERS
             if getattr(sys.modules.get(name), "DistributedDataParallel", None) is TORCH_DDP]
    if early:
        warnings.warn(f"pycomm.patch(): imported before it, {', '.join(early)} bound torch's "
                      f"DistributedDataParallel and will keep constructing it; call "
                      f"pycomm.patch() before importing Lightning, or use "
                      f"Trainer(strategy=pycomm.lightning.DDPStrategy(...))", stacklevel=3)


def patch(clip_grad_norm: bool = True) -> Patch:
    """Point torch.nn.parallel(.distributed).DistributedDataParallel at pycomm's class and,
    with clip_grad_norm, torch.nn.utils(.clip_grad).clip_grad_norm_ at pycomm's fused clip
    (plain and DTensor gradients; torch's still serves sparse gradients, other subclasses
    and orders <= 0). Returns a
    Patch: `p.undo()`, or `with pycomm.patch(): ...`. torch's originals stay reachable as
    pycomm.patching.TORCH_DDP and TORCH_CLIP_GRAD_NORM_."""
    names = [(m, n, DistributedDataParallel) for m, n in _DDP_NAMES]
    if clip_grad_norm:
        names += [(m, n, clip_grad_norm_) for m, n in _CLIP_NAMES]
    replaced = []
    for module, name, new in names:
        replaced.append((module, name, getattr(module, name)))
        setattr(module, name, new)
    _warn_early_binders()
    return Patch(replaced)
