"""Clipping each rank's local gradients before the all-reduce (DDPConfig.local_clip_max_norm,
See Note [Clip after vs before the all-reduce] in pycomm/clip.py) against plain torch:
torch's DDP under no_sync (local gradients only), torch.nn.utils.clip_grad_norm_ on each
rank, then the average all-reduce written out (or the comm hook's own reduction). 2 and 3
ranks, with no_sync accumulation, with torch's allreduce and fp16 compression hooks, and a
check that no bucket was launched before backward ended."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from ddp_models import assert_same, build, loss_of, make_input
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from multirank import run_ranks

# Below the MLP's local gradient norms (~0.05-0.5): clipping is active on every rank.
MAX_NORM = 1e-2


def _average(module, world, hook):
    """The reduction the oracle applies after its local clip: pycomm's default numerics
    (grad * 1/world, summed), or what torch's allreduce / fp16 compression hooks do."""
    for p in module.parameters():
        g = p.grad
        if hook == "fp16_compress_hook":
            h = g.to(torch.float16).div_(world)
            dist.all_reduce(h)
            p.grad = h.to(g.dtype)
        elif hook == "allreduce_hook":
            g.div_(world)
            dist.all_reduce(g)
        else:
            g.mul_(1.0 / world)
            dist.all_reduce(g)


def _lockstep(rank, world, no_sync_every=0, hook=None, norm_type=2.0):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))  # only ever under no_sync: local gradients
    cfg = pycomm.DDPConfig(bucket_cap_mb=1e-3, local_clip_max_norm=MAX_NORM,
                           local_clip_norm_type=norm_type)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    if hook:
        ours.register_comm_hook(None, getattr(default_hooks, hook))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, ours)]
    what = f"world={world} hook={hook} no_sync_every={no_sync_every} p={norm_type}"
    for step in range(3):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for micro in range(no_sync_every + 1):
            x = make_input("mlp", rank, 100 * step + micro)
            with ref.no_sync():
                loss_of(ref(x)).backward()
            if micro < no_sync_every:
                with ours.no_sync():
                    loss_of(ours(x)).backward()
            else:
                loss_of(ours(x)).backward()
        local = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)
        assert local.item() > MAX_NORM, f"{what}: clipping must be active"
        _average(ref.module, world, hook)
        # The local norm is summed over buckets instead of per tensor: fp32 order noise.
        torch.testing.assert_close(ours.local_grad_norm(), local, rtol=1e-5, atol=0, msg=what)
        # coef*(1/world) in one multiply vs torch's two roundings, 3-rank sum order: fp32
        # noise (2 ranks without hook: powers of two, still within it); fp16 compression:
        # an fp16 ulp where the coefficients' fp32 noise flips a rounding.
        if hook == "fp16_compress_hook":
            for p, q in zip(ref.module.parameters(), ours.module.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=2e-3, atol=1e-7, msg=what)
        else:
            assert_same(ref.module, ours.module, f"{what} step {step}", exact=False)
        for opt in opts:
            opt.step()
        # The parameters keep moving in lockstep (the fp16 case re-syncs them: its grads
        # may differ by one fp16 ulp, which the comparison above allows).
        if hook == "fp16_compress_hook":
            ours.module.load_state_dict(ref.module.state_dict())
    timeline = ours.timelines(1)[-1]
    last_ready = max(b["ready_ns"] for b in timeline["buckets"])
    assert len(timeline["buckets"]) > 1
    assert all(b["launch_ns"] >= last_ready for b in timeline["buckets"]), \
        f"{what}: a bucket launched before backward ended"


def _two_ranks(rank, world_size):
    _lockstep(rank, world_size)
    _lockstep(rank, world_size, no_sync_every=2, norm_type=float("inf"))
    _lockstep(rank, world_size, hook="allreduce_hook", no_sync_every=1)
    _lockstep(rank, world_size, hook="fp16_compress_hook")


def _three_ranks(rank, world_size):
    _lockstep(rank, world_size, no_sync_every=1)


def test_local_clip_before_allreduce_matches_torch_two_ranks():
    run_ranks(_two_ranks, 2)


def test_local_clip_before_allreduce_matches_torch_three_ranks():
    run_ranks(_three_ranks, 3)


def test_local_clip_config_is_checked():
    with pytest.raises(ValueError, match="local_clip_max_norm must be positive"):
        pycomm.DDPConfig(local_clip_max_norm=0.0)
    with pytest.raises(ValueError, match="local_clip_norm_type"):
        pycomm.DDPConfig(local_clip_max_norm=1.0, local_clip_norm_type=-1.0)
