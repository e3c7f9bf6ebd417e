"""DistributedDataParallel.clip_grad_norm_ against the oracle: torch's DDP, then
torch.nn.utils.clip_grad_norm_ on its synchronized gradients. With and without no_sync,
with and without torch's fp16_compress_hook, on 2 Gloo ranks, over several SGD steps."""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import assert_same, build, loss_of, make_input
from tests.support.multirank import run_ranks

# max_norm far below the MLP's gradient norm: clipping is active every step.
MAX_NORM = 1e-4


def _step(ddp, opt, model, rank, step, no_sync_every, clip, device):
    opt.zero_grad(set_to_none=True)
    for micro in range(no_sync_every):
        with ddp.no_sync():
            loss_of(ddp(make_input(model, rank, 100 * step + micro + 1).to(device))).backward()
    loss_of(ddp(make_input(model, rank, 100 * step).to(device))).backward()
    total = clip(ddp)
    opt.step()
    return total


def _lockstep_clip(rank, model="mlp", no_sync_every=0, hook=None, norm_type=2.0, steps=3,
                   device="cpu", **ddp_kwargs):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    base = build(model).to(device)
    ref = TorchDDP(copy.deepcopy(base), **ddp_kwargs)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    if hook:
        for ddp in (ref, ours):
            ddp.register_comm_hook(None, getattr(default_hooks, hook))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, ours)]
    used_buckets = []
    for step in range(steps):
        t_ref = _step(ref, opts[0], model, rank, step, no_sync_every,
                      lambda d: torch.nn.utils.clip_grad_norm_(d.parameters(), MAX_NORM,
                                                               norm_type), device)

        def clip_ours(d, step=step):
            if step > 0:  # attached at step 0: from then on the partials come from backward
                n = len(d.reducer.bucket_indices())
                used_buckets.append(d._runtime.bucket_norms.complete(n, norm_type))
            return d.clip_grad_norm_(MAX_NORM, norm_type)

        t_ours = _step(ours, opts[1], model, rank, step, no_sync_every, clip_ours, device)
        what = f"step {step} {model} hook={hook} no_sync_every={no_sync_every} p={norm_type}"
        assert t_ref.item() > MAX_NORM, f"{what}: clipping must be active"
        # Same averaged gradients (bitwise for 2 ranks); the norm is summed per bucket
        # instead of per tensor: fp32 summation-order noise, inherited by the parameters.
        torch.testing.assert_close(t_ours, t_ref, rtol=1e-5, atol=0, msg=what)
        assert_same(ref.module, ours.module, what, exact=False)
    assert all(used_buckets), f"per-bucket partials were not used: {used_buckets}"


def _cases(rank, world_size):
    _lockstep_clip(rank)
    _lockstep_clip(rank, norm_type=float("inf"), bucket_cap_mb=1e-6)
    _lockstep_clip(rank, no_sync_every=2, bucket_cap_mb=1e-6)
    _lockstep_clip(rank, hook="fp16_compress_hook")
    _lockstep_clip(rank, hook="fp16_compress_hook", no_sync_every=1, gradient_as_bucket_view=True)


def test_ddp_clip_grad_norm_matches_torch_ddp_then_clip():
    run_ranks(_cases, 2)


def _no_sync_computes_nothing(rank, world_size):
    ddp = pycomm.DistributedDataParallel(build("mlp"))
    loss_of(ddp(make_input("mlp", rank, 0))).backward()
    ddp.clip_grad_norm_(1.0)  # attaches the per-bucket partials
    n = len(ddp.reducer.bucket_indices())
    with ddp.no_sync():
        loss_of(ddp(make_input("mlp", rank, 1))).backward()
    assert not ddp._runtime.bucket_norms.complete(n, 2.0), "a partial was computed under no_sync"
    loss_of(ddp(make_input("mlp", rank, 2))).backward()
    assert ddp._runtime.bucket_norms.complete(n, 2.0)


def test_no_sync_backward_computes_no_partial():
    run_ranks(_no_sync_computes_nothing, 2)
