"""The two gradient modes of pycomm.ZeroRedundancyOptimizer on pycomm's DDP (Note [Two
gradient modes] in pycomm/zero/optimizer.py). By default a torch user's habits give
torch's results: torch's clip_grad_norm_, a norm logged from param.grad and torch's
GradScaler, against torch's DDP with torch's ZeroRedundancyOptimizer on the same inputs.
With release_gradients=True param.grad is None after a synchronized backward, and
pycomm's clip and ShardedGradScaler give those results from the shards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks

_CLIP = 0.01


def _logged_norm(params) -> torch.Tensor:
    """What a training script logs: the gradients' global norm, read from param.grad."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _habits(ddp, opt, rank, scaler_class, clip, steps=4):
    """A torch user's AMP loop: scaled backward, unscale_, a logged norm, a clip, the
    scaler's step and update. Returns (logged norms, clip norms, scales)."""
    scaler = scaler_class("cpu", init_scale=2.0 ** 8)
    logged, clipped, scales = [], [], []
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(loss_of(ddp(make_input("mlp", rank, step)))).backward()
        scaler.unscale_(opt)
        logged.append(_logged_norm(ddp.parameters()))
        clipped.append(clip(ddp))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return torch.stack(logged), torch.stack(clipped), scales


def _torch_clip(ddp):
    return torch.nn.utils.clip_grad_norm_(ddp.parameters(), _CLIP)


def _pycomm_clip(ddp):
    return pycomm.clip_grad_norm_(ddp.parameters(), _CLIP)


def _torch_habits_give_torch_results(rank, world_size):
    base = build("mlp")
    cfg = pycomm.DDPConfig(bucket_cap_mb=5e-4)
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=5e-4)
    ref_opt = TorchZero(ref.parameters(), torch.optim.AdamW, lr=1e-2)
    want = _habits(ref, ref_opt, rank, torch.amp.GradScaler, _torch_clip)
    assert all(n > _CLIP for n in want[1]), f"the test must clip: {want[1]}"
    for release, scaler, clip in ((False, torch.amp.GradScaler, _torch_clip),
                                  (True, pycomm.ShardedGradScaler, _pycomm_clip)):
        ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
        zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                              release_gradients=release)
        got = _habits(ddp, zero, rank, scaler, clip)
        zero.wait_for_params()
        what = "released" if release else "kept"
        if not release:  # param.grad is the average: the logged norm is torch's
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0, msg=what)
        else:  # nothing in param.grad to log: pycomm's clip returns the norm instead
            assert all(n == 0 for n in got[0]), what
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0, msg=what)
        assert got[2] == want[2], what
        for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def test_torch_clip_logging_and_grad_scaler_give_torch_results():
    run_ranks(_torch_habits_give_torch_results, 2)


def _what_param_grad_holds(rank, world_size):
    """Kept: after the synchronized backward, until step() or zero_grad(), param.grad is
    torch's DDP's averaged gradient, bit for bit, and it stays through the step; released:
    None. torch's GradScaler finds no gradient to unscale on the released optimizer and
    raises, rather than stepping unscaled gradients."""
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    loss_of(ref(make_input("mlp", rank, 0))).backward()
    for release in (False, True):
        ddp = pycomm.DistributedDataParallel(copy.deepcopy(base))
        zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                              release_gradients=release)
        loss_of(ddp(make_input("mlp", rank, 0))).backward()
        for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters()):
            if release:
                assert p.grad is None, name
            else:
                assert torch.equal(p.grad, q.grad), name
        if not release:  # its own clip clips param.grad whole, as torch's does
            twin = copy.deepcopy(ref.module)  # torch's clip on torch's DDP's gradients
            for q, t in zip(ref.module.parameters(), twin.parameters()):
                t.grad = q.grad.clone()
            want_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
            want = [t.grad for t in twin.parameters()]
            got_norm = zero.clip_grad_norm_(0.01)
            torch.testing.assert_close(got_norm, want_norm, rtol=1e-6, atol=0)
            for (name, p), w in zip(ddp.module.named_parameters(), want):
                torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-9,
                                           msg=lambda m, n=name: f"{n}: {m}")
        grads = [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
        zero.step()
        for p, g in zip(ddp.parameters(), grads):
            assert (p.grad is None and g is None) or torch.equal(p.grad, g)
        zero.zero_grad()
        assert all(p.grad is None for p in ddp.parameters())
        if release:
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(loss_of(ddp(make_input("mlp", rank, 1)))).backward()
            with pytest.raises(AssertionError, match="No inf checks were recorded"):
                scaler.step(zero)


def test_param_grad_in_each_mode():
    run_ranks(_what_param_grad_holds, 2)


def _first_step_reads_what_the_user_left(rank, world_size):
    """bf16 parameters, fp32 main_grad: the first step runs the DDP's bucket re-cut, and
    steps the gradients as the user left them after the backward (a clip or unscale
    in between counts), in param.grad or, with main_grad_only, in param.main_grad. SGD at
    lr 1 on fp32 main parameters: each parameter moves by exactly its gradient."""
    for main_grad_only in (False, True):
        for wrapped_after in (False, True):
            base = build("mlp").to(torch.bfloat16)
            cfg = pycomm.DDPConfig(bucket_cap_mb=5e-4, grad_reduce_dtype=torch.float32,
                                   main_grad_only=main_grad_only)
            bare = copy.deepcopy(base)
            if wrapped_after:  # See Note [Wrapped after the optimizer] in binding.py
                zero = pycomm.ZeroRedundancyOptimizer(bare.parameters(), torch.optim.SGD, lr=1.0)
                ddp = pycomm.DistributedDataParallel(bare, config=cfg)
            else:
                ddp = pycomm.DistributedDataParallel(bare, config=cfg)
                zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=1.0)
            before = [p.detach().float().clone() for p in ddp.parameters()]
            loss_of(ddp(make_input("mlp", rank, 0).to(torch.bfloat16))).float().backward()
            grads = [p.main_grad if main_grad_only else p.grad for p in ddp.parameters()]
            assert all(g is not None for g in grads)
            with torch.no_grad():
                for g in grads:
                    g.mul_(0.5)  # a clip the step must see
            want = [(b - g.float()).to(torch.bfloat16) for b, g in zip(before, grads)]
            zero.step()
            zero.wait_for_params()
            how = f"main_grad_only={main_grad_only} wrapped_after={wrapped_after}"
            assert not ddp.reducer.should_rebuild_buckets(), how
            for (name, p), w in zip(ddp.module.named_parameters(), want):
                off = (p.float() - w.float()).abs().max()
                assert torch.equal(p, w), f"{how}: {name} off by {off}"


def test_first_step_steps_the_gradients_the_user_left():
    run_ranks(_first_step_reads_what_the_user_left, 2)


def _unscale_reads_main_grad(rank, world_size):
    """With main_grad_only param.grad is None and the step reads param.main_grad: that is
    what the scaler unscales (and checks)."""
    base = build("mlp").to(torch.bfloat16)
    cfg = pycomm.DDPConfig(grad_reduce_dtype=torch.float32, main_grad_only=True)
    ddp = pycomm.DistributedDataParallel(base, config=cfg)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    scaler = pycomm.ShardedGradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(loss_of(ddp(make_input("mlp", rank, 0).to(torch.bfloat16))).float()).backward()
    scaled = [p.main_grad.clone() for p in ddp.parameters()]
    scaler.unscale_(zero)
    for p, s in zip(ddp.parameters(), scaled):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, s / 2.0 ** 8, rtol=0, atol=0)
    scaler.step(zero)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 8


def test_the_scaler_unscales_main_grad_with_main_grad_only():
    run_ranks(_unscale_reads_main_grad, 2)


def _state_loaded_before_wrapping(rank, world_size):
    """A checkpoint loaded into the optimizer before the module is wrapped (a trainer's
    resume order), with two groups whose order is not the DDP's: each state reaches its own
    parameter when the optimizer moves onto the DDP, so training resumes as an unsharded
    AdamW loaded the same way."""
    base = build("mlp")
    ref = copy.deepcopy(base)
    groups = lambda m: [{"params": [p for p in m.parameters() if p.dim() <= 1],  # noqa: E731
                         "weight_decay": 0.0},
                        {"params": [p for p in m.parameters() if p.dim() > 1],
                         "weight_decay": 0.1}]
    warm = torch.optim.AdamW(groups(ref), lr=1e-2)
    loss_of(ref(make_input("mlp", 0, 99))).backward()
    warm.step()
    saved = copy.deepcopy(warm.state_dict())
    plain_module = pycomm.DistributedDataParallel(copy.deepcopy(ref))
    plain = torch.optim.AdamW(groups(plain_module), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(saved))
    bare = copy.deepcopy(ref)
    zero = pycomm.ZeroRedundancyOptimizer(groups(bare), torch.optim.AdamW, lr=1e-2)
    zero.load_state_dict(copy.deepcopy(saved))
    sharded = pycomm.DistributedDataParallel(bare)
    for step in range(3):
        for m, opt in ((sharded, zero), (plain_module, plain)):
            opt.zero_grad()
            loss_of(m(make_input("mlp", rank, step))).backward()
            opt.step()
    zero.wait_for_params()
    for (name, p), q in zip(sharded.module.named_parameters(), plain_module.module.parameters()):
        assert torch.equal(p, q), f"{name} off by {(p - q).abs().max()}"


def test_state_loaded_before_wrapping_follows_its_parameters():
    run_ranks(_state_loaded_before_wrapping, 2)
