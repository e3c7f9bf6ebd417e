"""torch 2.15's manual backward finalization on pycomm's DistributedDataParallel:
`require_manual_backward_finalization`, `should_finalize_after_backward` and
`finalize_backward()`. The mode and its checks are the C++ reducer's (See Note [Manual
backward finalization] in csrc/reducer/finalize.cpp); this mixin is their face in torch's
names. module.py mixes it in only where the installed torch's DDP has the API, so that on
an older torch pycomm's DDP lacks it as torch's does."""

from __future__ import annotations

from typing import Any

from .compat import TORCH_DDP

TORCH_HAS_MANUAL_FINALIZATION = hasattr(TORCH_DDP, "finalize_backward")
"""Whether the installed torch's DDP has manual backward finalization (torch >= 2.15)."""


class ManualFinalization:
    """torch's manual backward finalization, on the reducer's mode."""

    reducer: Any
    _delayed: Any

    @property
    def require_manual_backward_finalization(self) -> bool:
        """Whether each synchronized backward waits for finalize_backward() to end it
        (False by default). Change it before a forward or after a finalized backward."""
        return self.reducer.manual_finalization

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, required: bool) -> None:
        self.reducer.set_manual_finalization(bool(required))

    @property
    def should_finalize_after_backward(self) -> bool:
        """With manual finalization: whether the coming backward must be finalized only after
        it returns (True in static_graph's first step, whose parameter usage is known only
        then); when False, finalize_backward() may also run from a hook once the last
        gradient is in. Always False without manual finalization."""
        return self.reducer.should_finalize_after_backward()

    def finalize_backward(self) -> None:
        """End a synchronized backward under manual finalization: wait for every bucket's
        collective and leave the reduced gradients in param.grad. Raises RuntimeError when
        manual finalization is off, when no synchronized backward awaits it (no_sync(), or
        already finalized), or before every gradient of the backward is in."""
        self.reducer.finalize_backward_manual()
