"""fp32 gradient accumulation for bf16/fp16 parameters (DDPConfig.grad_reduce_dtype, See
Note [main_grad accumulation]): the gradients of several no_sync micro-steps add up in the
fp32 param.main_grad and the synchronized backward reduces that sum. The oracle is written
out in plain torch: the same micro-step gradients (in the parameter's dtype, as autograd
makes them) summed in fp32, scaled by 1/world, all-reduced. Plain low-precision
accumulation, what torch's DDP does, is shown measurably worse, so the test can fail."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks

MICRO = 8  # micro-steps per optimizer step: 7 under no_sync, then the synchronized one


def _micro_input(rank: int, step: int, micro: int, dtype: torch.dtype,
                 device: str = "cpu") -> torch.Tensor:
    return make_input("mlp", rank, 100 * step + micro, batch=16).to(device, dtype)


def _oracle(base, rank, world, step, dtype, device="cpu"):
    """fp32 sum of the micro-steps' low-precision gradients, times 1/world, all-reduced."""
    model = copy.deepcopy(base)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for micro in range(MICRO):
        model.zero_grad(set_to_none=True)
        loss_of(model(_micro_input(rank, step, micro, dtype, device))).backward()
        for s, p in zip(sums, model.parameters()):
            s += p.grad.float()
    for s in sums:
        s.mul_(1.0 / world)  # pycomm's (and torch DDP's) numerics: scale, then sum
        dist.all_reduce(s)
    return sums


def _accumulate(ddp, rank, step, dtype, rebuild_midway=False, device="cpu"):
    ddp.zero_grad(set_to_none=True)  # the last step handed back param.grad (default mode)
    for micro in range(MICRO - 1):
        with ddp.no_sync():
            loss_of(ddp(_micro_input(rank, step, micro, dtype, device))).backward()
        for p in ddp.module.parameters():
            assert p.grad is None, "a micro-step's low-precision grad was kept"
        if rebuild_midway and micro == 2:  # a rebuild must carry the pending fp32 sums
            ddp.reducer.rebuild_buckets([list(b) for b in reversed(ddp.reducer.bucket_indices())])
            ddp._set_main_grads()
    loss_of(ddp(_micro_input(rank, step, MICRO - 1, dtype, device))).backward()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def _bf16_accumulation_error(base, rank, step, want, dtype, device="cpu") -> float:
    """torch's DDP on the low-precision model: no_sync sums in the parameter's dtype."""
    ref = TorchDDP(copy.deepcopy(base))
    for micro in range(MICRO - 1):
        with ref.no_sync():
            loss_of(ref(_micro_input(rank, step, micro, dtype, device))).backward()
    loss_of(ref(_micro_input(rank, step, MICRO - 1, dtype, device))).backward()
    return max(_rel_err(p.grad, w) for p, w in zip(ref.module.parameters(), want))


def _check(rank, world_size, dtype, main_grad_only, exact, device="cpu"):
    base = build("mlp").to(device, dtype)
    cfg = pycomm.DDPConfig(grad_reduce_dtype=torch.float32, bucket_cap_mb=1e-3,
                           main_grad_only=main_grad_only)
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    what = f"{dtype} main_grad_only={main_grad_only} world={world_size}"
    for step in range(2):  # step 1 runs on the buckets rebuilt after step 0
        want = _oracle(base, rank, world_size, step, dtype, device)
        _accumulate(ddp, rank, step, dtype, rebuild_midway=step == 1, device=device)
        for (name, p), w in zip(ddp.module.named_parameters(), want):
            if exact:  # same adds in the same order, 2-term sums: bitwise
                assert torch.equal(p.main_grad, w), f"{what}: main_grad of {name} step {step} " \
                    f"{_rel_err(p.main_grad, w)}"
            else:  # 3 ranks: the all-reduce may add in another order (fp32 rounding)
                torch.testing.assert_close(p.main_grad, w, rtol=1e-6, atol=1e-9)
            if main_grad_only:
                assert p.grad is None, f"{what}: {name}.grad was handed back"
            else:
                assert p.grad.dtype == dtype
                # the fp32 result rounded once; 3 ranks: an fp32 ulp may flip a rounding
                torch.testing.assert_close(p.grad, w.to(dtype), rtol=0 if exact else 1e-2,
                                           atol=0)
    ours = max(_rel_err(p.main_grad, w) for p, w in zip(ddp.module.parameters(), want))
    theirs = _bf16_accumulation_error(base, rank, 1, want, dtype, device)
    # fp32 accumulation sits at fp32 noise (0 with 2 ranks); low-precision accumulation of
    # 8 micro-steps loses ~3e-3 (bf16) or ~4e-4 (fp16) of a gradient's norm (measured).
    assert ours < 1e-6, f"{what}: fp32 accumulation error {ours}"
    assert theirs > 100 * max(ours, 1e-7), f"{what}: low-precision accumulation error " \
                                           f"{theirs} is not measurably worse than {ours}"


def _clip_main_grad_only(rank, world_size):
    """ddp.clip_grad_norm_ clips param.main_grad when param.grad is left None, and so does
    pycomm.clip_grad_norm_(ddp.parameters()): the standalone clip scales what the optimizer
    steps on, not the None param.grad (which would clip nothing, silently)."""
    base = build("mlp").to(torch.bfloat16)
    cfg = pycomm.DDPConfig(grad_reduce_dtype=torch.float32, main_grad_only=True)
    want = _oracle(base, rank, world_size, 0, torch.bfloat16)
    refs = [torch.zeros_like(w).requires_grad_() for w in want]
    for r, w in zip(refs, want):
        r.grad = w.clone()
    expect = torch.nn.utils.clip_grad_norm_(refs, 1e-3)
    assert expect.item() > 1e-3, "clipping must be active"
    clips = {"ddp": lambda ddp: ddp.clip_grad_norm_(1e-3),
             "standalone": lambda ddp: pycomm.clip_grad_norm_(ddp.parameters(), 1e-3)}
    for how, clip in clips.items():
        ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
        _accumulate(ddp, rank, 0, torch.bfloat16)
        total = clip(ddp)
        # the norm is summed per bucket or per tensor: fp32 summation-order noise
        torch.testing.assert_close(total, expect, rtol=1e-5, atol=0, msg=how)
        for p, r in zip(ddp.module.parameters(), refs):
            assert p.grad is None, how
            torch.testing.assert_close(p.main_grad, r.grad, rtol=1e-5, atol=1e-9, msg=how)


def _two_ranks(rank, world_size):
    for dtype in (torch.bfloat16, torch.float16):
        _check(rank, world_size, dtype, main_grad_only=False, exact=True)
    _check(rank, world_size, torch.bfloat16, main_grad_only=True, exact=True)
    _clip_main_grad_only(rank, world_size)


def _three_ranks(rank, world_size):
    _check(rank, world_size, torch.bfloat16, main_grad_only=False, exact=False)


def test_no_sync_accumulates_bf16_fp16_grads_in_fp32_two_ranks():
    run_ranks(_two_ranks, 2)


def test_no_sync_accumulates_in_fp32_three_ranks():
    run_ranks(_three_ranks, 3)


def test_main_grad_only_needs_grad_reduce_dtype():
    import pytest
    with pytest.raises(ValueError, match="main_grad_only needs grad_reduce_dtype"):
        pycomm.DDPConfig(main_grad_only=True)
