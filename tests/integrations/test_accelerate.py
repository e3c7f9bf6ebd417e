"""Accelerate with pycomm.patch(): a training loop with `accelerator.accumulate` and
`accelerator.clip_grad_norm_`, then a backward synchronized by
`trigger_sync_in_backward`, against the same loop on torch's DDP: same losses, norms and
parameters; `unwrap_model` gives the bare module and `save_model` writes its keys (no
`module.` prefix)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

import pycomm
from tests.support.ddp_models import MLP
from tests.support.multirank import free_port, run_ranks, set_launcher_env

_CLIP = 0.05
_STEPS, _ACCUMULATE, _BATCH = 3, 2, 4


def _data_and_model(world_size):
    """The loops' data (the same on every rank: Accelerate's loader shards it), a fresh
    MLP (seed 0), and the generator that drew the data, for more."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    n = world_size * _STEPS * _ACCUMULATE * _BATCH
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
    torch.manual_seed(0)
    return g, data, MLP()


def _loop(accelerator, model, optimizer, loader):
    """The training loop both tests run: accumulate, clip on the synchronized micro-step,
    step; each micro-step's loss and each clip's norm."""
    losses, norms = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), _CLIP))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, norms


def _train(accelerator, use_pycomm, world_size, out_dir):
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    g, data, bare = _data_and_model(world_size)
    extra = [torch.randn(_BATCH, 8, generator=g) for _ in range(2 * world_size)]
    optimizer = torch.optim.SGD(bare.parameters(), lr=0.5)
    with pycomm.patch() if use_pycomm else contextlib.nullcontext():
        model, optimizer, loader = accelerator.prepare(bare, optimizer,
                                                       DataLoader(data, batch_size=_BATCH))
        losses, norms = _loop(accelerator, model, optimizer, loader)
        rank = accelerator.process_index
        with accelerator.no_sync(model):
            loss_a = model(extra[2 * rank]).square().mean()
            loss_b = model(extra[2 * rank + 1]).square().mean()
        accelerator.backward(loss_a)
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)
        grads = [p.grad.clone() for p in model.parameters()]
    assert isinstance(model, pycomm.DistributedDataParallel) == use_pycomm
    if use_pycomm:  # accumulate ran the first micro-batch of each step under no_sync, and
        # trigger_sync_in_backward synchronized the backward after the no_sync forwards
        assert len(model.timelines(64)) == _STEPS + 1
    assert accelerator.unwrap_model(model) is bare
    accelerator.save_model(model, out_dir)
    accelerator.wait_for_everyone()
    saved = load_file(os.path.join(out_dir, "model.safetensors"))
    assert not any(k.startswith("module.") for k in saved)
    reloaded = MLP()
    reloaded.load_state_dict(saved)
    for a, b in zip(reloaded.parameters(), bare.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return torch.stack(losses), torch.stack(norms), grads, list(bare.parameters())


def _loop_both(rank, world_size, port, root):
    set_launcher_env(rank, world_size, port)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=_ACCUMULATE)
    theirs = _train(accelerator, False, world_size, os.path.join(root, "torch"))
    ours = _train(accelerator, True, world_size, os.path.join(root, "pycomm"))
    # Every step clipped (so a clip that did nothing, or clipped otherwise, would show).
    assert min(theirs[1]) > _CLIP
    # Two ranks: gradients average bit-exactly as torch's do; the clip's fused norm sums
    # squares in another order than torch's foreach norm, a few fp32 ulp per step, which
    # the next steps carry: 1e-5 relative is far above that and far below any real error.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_accumulate_clip_and_trigger_sync_match_torch_ddp(tmp_path):
    pytest.importorskip("accelerate", reason="the integrations extra (accelerate) is absent")
    run_ranks(_loop_both, port=free_port(), root=str(tmp_path))


def _train_adamw(accelerator, how, world_size):
    """AdamW through Accelerate with accumulation and clip_grad_norm_: "torch" (torch's
    DDP and AdamW); "sharded" (the model prepared first, then the sharded optimizer built
    on the wrapped module and prepared); "early" (the sharded optimizer built on the bare
    module, both prepared together: Accelerate's usual order, after which the optimizer
    moves onto the DDP at its first step; Note [Wrapped after the optimizer] in
    pycomm/zero/binding.py); both keep the gradients (torch's contract). "released" is
    "sharded" with release_gradients=True, whose clip must be pycomm's (it reads the
    shards). All under pycomm.patch(), which makes Accelerate wrap in pycomm's DDP. eps=0.1,
    far above sqrt(v) here, makes AdamW's step follow the gradients' scale, so that a clip
    that did not scale would show (with a tiny eps AdamW undoes a uniform scale)."""
    from torch.utils.data import DataLoader

    _, data, bare = _data_and_model(world_size)
    release = how == "released"
    with pycomm.patch() if how != "torch" else contextlib.nullcontext():
        if how == "torch":
            adamw = torch.optim.AdamW(bare.parameters(), lr=0.05, eps=0.1)
            model, optimizer = accelerator.prepare(bare, adamw)
        elif how in ("sharded", "released"):
            model = accelerator.prepare(bare)
            optimizer = accelerator.prepare(pycomm.ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.AdamW, lr=0.05, eps=0.1,
                release_gradients=release))
        else:
            model, optimizer = accelerator.prepare(bare, pycomm.ZeroRedundancyOptimizer(
                bare.parameters(), torch.optim.AdamW, lr=0.05, eps=0.1))
        loader = accelerator.prepare(DataLoader(data, batch_size=_BATCH))
        losses, norms = _loop(accelerator, model, optimizer, loader)
    zero = optimizer.optimizer
    if how != "torch":
        zero.wait_for_params()
        assert zero._ddp is model and zero.grads_in_shards == release, how
    return torch.stack(losses), torch.stack(norms), list(bare.parameters())


def _adamw_all_ways(rank, world_size, port):
    set_launcher_env(rank, world_size, port)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=_ACCUMULATE)
    theirs = _train_adamw(accelerator, "torch", world_size)
    assert min(theirs[1]) > _CLIP  # every step clipped
    for how in ("sharded", "early", "released"):
        # Two ranks: the averaged gradients are the same bits; the clip's norm adds in
        # another order than torch's foreach (a few fp32 ulp, carried by later steps).
        torch.testing.assert_close(_train_adamw(accelerator, how, world_size), theirs,
                                   rtol=1e-5, atol=1e-6, msg=lambda m, h=how: f"{h}: {m}")


def test_sharded_optimizer_through_prepare_matches_torch_adamw():
    pytest.importorskip("accelerate", reason="the integrations extra (accelerate) is absent")
    run_ranks(_adamw_all_ways, port=free_port())
