"""Clipping each rank's local gradients before the all-reduce (DDPConfig.local_clip_max_norm,
See Note [Clip after vs before the all-reduce] in pycomm/ddp/clip.py) against plain torch:
torch's DDP under no_sync (local gradients only), torch.nn.utils.clip_grad_norm_ on each
rank, then the average all-reduce written out (or the comm hook's own reduction). 2 and 3
ranks, with no_sync accumulation, with torch's allreduce and fp16 compression hooks, a
check that no bucket was launched before backward ended, local_clip_error_if_nonfinite
(one rank's gradients are inf, then nan), and join() with uneven inputs."""

from __future__ import annotations

import copy
import math
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import assert_same, build, loss_of, make_input
from tests.support.multirank import run_ranks

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


def _lockstep(rank, world, no_sync_every=0, hook=None, norm_type=2.0, device="cpu"):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    base = build("mlp").to(device)
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
            x = make_input("mlp", rank, 100 * step + micro).to(device)
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
    # Host stamps: a device bucket's ready time is its device event, which the host's
    # launch may precede while the device lags behind (Note [Timeline] in timeline.h); a
    # launch after every parameter's hook is what the local clip promises.
    last_ready = max(t for t in timeline["param_ready_ns"] if t >= 0)
    assert len(timeline["buckets"]) > 1
    assert all(b["launch_ns"] >= last_ready for b in timeline["buckets"]), \
        f"{what}: a bucket launched before backward ended"


def _clip_and_average(ref, world, divisor=None):
    """The oracle's synchronized step on the local gradients in ref (a torch DDP only used
    under no_sync): torch's clip_grad_norm_, then x * (1/divisor) summed over the ranks."""
    local = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert local.item() > MAX_NORM, "clipping must be active"
    for p in ref.module.parameters():
        p.grad.mul_(1.0 / (divisor or world))
        dist.all_reduce(p.grad)


def _oracle_and_ours(error_if_nonfinite):
    """torch's DDP (only ever run under no_sync: local gradients) and pycomm's with local
    clipping, on the same MLP, each with its SGD."""
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    cfg = pycomm.DDPConfig(bucket_cap_mb=1e-3, local_clip_max_norm=MAX_NORM,
                           local_clip_error_if_nonfinite=error_if_nonfinite)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, ours)]
    return ref, ours, opts


def _nonfinite(rank, world):
    ref, ours, opts = _oracle_and_ours(error_if_nonfinite=True)
    # (the rank whose local gradients are not finite, what its loss is scaled by)
    for step, (bad_rank, bad) in enumerate(((None, 1.0), (1, math.inf), (None, 1.0),
                                            (1, math.nan))):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        x = make_input("mlp", rank, step)
        scale = bad if rank == bad_rank else 1.0
        with ref.no_sync():
            (loss_of(ref(x)) * scale).backward()
        if bad_rank is None:
            loss_of(ours(x)).backward()
            _clip_and_average(ref, world)
            assert_same(ref.module, ours.module, f"finite step {step}", exact=False)
            for opt in opts:
                opt.step()
            continue
        local = [p.grad.clone() for p in ref.parameters()]
        if rank == bad_rank:  # what torch does with these gradients: raise, leave them
            with pytest.raises(RuntimeError, match="non-finite") as raised:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM,
                                               error_if_nonfinite=True)
            for g, p in zip(local, ref.parameters()):
                torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
            # torch's words, character for character, in the local clip's context
            expected = r"\(rank 1\), this rank's local norm is (inf|nan): " + \
                       re.escape(str(raised.value)) + \
                       r" \(DDPConfig.local_clip_error_if_nonfinite here\); nothing was reduced"
        else:
            expected = r"\(rank 0\): rank\(s\) 1 had a non-finite local gradient norm"
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=expected):
            (loss_of(ours(x)) * scale).backward()
        # Every rank knows at once (the flag all-reduce), long before the 60 s group timeout.
        assert time.monotonic() - start < 10
        assert torch.isfinite(ours.local_grad_norm()).item() == (rank != bad_rank)
        for g, q in zip(local, ours.module.parameters()):  # local, unclipped, unreduced
            torch.testing.assert_close(q.grad, g, rtol=0, atol=0, equal_nan=True)


def test_local_clip_error_if_nonfinite_raises_on_every_rank():
    run_ranks(_nonfinite, 2, group_timeout_s=60, deadline_s=90)


def _join(rank, world, divide_by_initial_world_size, error_if_nonfinite):
    """Rank 1 runs out of data after one step; the oracle adds zeros for it."""
    steps = [3, 1][rank]
    ref, ours, opts = _oracle_and_ours(error_if_nonfinite)
    with ours.join(divide_by_initial_world_size=divide_by_initial_world_size):
        for step in range(steps):
            opts[1].zero_grad()
            loss_of(ours(make_input("mlp", rank, step))).backward()
            opts[1].step()
    for step in range(3):
        opts[0].zero_grad()
        if step < steps:
            with ref.no_sync():
                loss_of(ref(make_input("mlp", rank, step))).backward()
        else:
            for p in ref.parameters():
                p.grad = torch.zeros_like(p)
        running = 2 if step < 1 else 1
        divisor = world if divide_by_initial_world_size else running
        if step < steps:
            _clip_and_average(ref, world, divisor)
        else:
            for p in ref.module.parameters():
                dist.all_reduce(p.grad)
        opts[0].step()
    # join() ends with every rank holding the last joiner's (rank 0's) parameters.
    assert_same(ref.module, ours.module, f"join divide_by_initial={divide_by_initial_world_size}",
                exact=False, grads=False)


def _join_both(rank, world_size):
    _join(rank, world_size, True, False)
    _join(rank, world_size, False, True)


def test_local_clip_with_join_uneven_inputs_matches_torch():
    run_ranks(_join_both, 2, deadline_s=90)


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
    with pytest.raises(ValueError, match="local_clip_error_if_nonfinite needs"):
        pycomm.DDPConfig(local_clip_error_if_nonfinite=True)
