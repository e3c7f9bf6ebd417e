"""pycomm.ShardedGradScaler (Note [Loss scaling over shards] in
pycomm/zero/grad_scaler.py): loss scaling with a pycomm.ZeroRedundancyOptimizer trains
as torch's DDP + the same optimizer + torch's GradScaler (bitwise at 1 and 2 ranks, to
rounding at 3) with the same scale every step, also when a gradient
overflows on one rank only (the average carries the inf into one rank's shard, and
every rank must skip that step); with any other optimizer it is torch's GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks

CAP = 5e-4  # MB: the MLP in several buckets
STEPS, OVERFLOW = 8, 3  # at step OVERFLOW rank 0's gradient of net.0.weight[0, 5] is inf


def _scaler(cls, device):
    return cls(device, init_scale=2.0 ** 12, growth_interval=2)


def _overflow(rank, step, module):
    """Rank 0's gradient of one element made inf at step OVERFLOW (a tensor hook, before
    the DDP sees it); the handle to remove, or None."""
    if rank != 0 or step != OVERFLOW:
        return None

    def inf_at(grad):
        grad = grad.clone()
        grad[0, 5] = float("inf")
        return grad

    return dict(module.named_parameters())["net.0.weight"].register_hook(inf_at)


def _train(ddp, opt, scaler, rank, unscaled=None):
    """The scale after each step; `unscaled` (a list) gets param.grad after each
    unscale_."""
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        handle = _overflow(rank, step, ddp.module)
        scaler.scale(loss_of(ddp(make_input("mlp", rank, step)))).backward()
        if handle is not None:
            handle.remove()
        if step % 2:  # as before a clip; on the other steps step() unscales
            scaler.unscale_(opt)
            if unscaled is not None:
                unscaled.append([p.grad.clone() for p in ddp.parameters()])
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _scaled(rank, world_size, device="cpu"):
    """Also on "cuda" (tests/gpu/test_zero_on_cuda.py: the DDPs move the inputs)."""
    base = build("mlp").to(device)
    ids = [0] if device == "cuda" else None
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), device_ids=ids,
                                          config=pycomm.DDPConfig(bucket_cap_mb=CAP))
    zero = pycomm.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-2)
    ref = TorchDDP(copy.deepcopy(base), device_ids=ids, bucket_cap_mb=CAP)
    got = _train(ours, zero, _scaler(pycomm.ShardedGradScaler, device), rank)
    unscaled: list = []
    want = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2),
                  _scaler(torch.amp.GradScaler, device), rank, unscaled)
    assert got == want, (got, want)
    assert want[OVERFLOW] == want[OVERFLOW - 1] / 2, f"step {OVERFLOW} must be skipped: {want}"
    zero.wait_for_params()
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        if world_size < 3:
            assert torch.equal(p, q), f"rank {rank}: {name} differs by {(p - q).abs().max():.3g}"
        else:  # torch's Gloo ring adds three terms in another order (test_zero_parity.py)
            torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6, msg=lambda m, n=name: n + m)
    # any other optimizer: torch's GradScaler; the sharded optimizer on torch's DDP (whole
    # gradients in param.grad): every gradient unscaled, as torch's scaler does
    for sharded in (False, True):
        plain = TorchDDP(copy.deepcopy(base), device_ids=ids, bucket_cap_mb=CAP)
        opt = (pycomm.ZeroRedundancyOptimizer(plain.parameters(), torch.optim.AdamW, lr=1e-2)
               if sharded else torch.optim.AdamW(plain.parameters(), lr=1e-2))
        seen: list = []
        got = _train(plain, opt, _scaler(pycomm.ShardedGradScaler, device), rank, seen)
        assert got == want, sharded
        for step, (a, b) in enumerate(zip(seen, unscaled)):  # what a clip would read
            assert all(torch.equal(g, h) for g, h in zip(a, b)), (sharded, step)
        for p, q in zip(plain.parameters(), ref.parameters()):  # torch's DDP's sums: bitwise
            assert torch.equal(p, q), sharded


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_scaler_skips_on_every_rank_and_matches_torch(world):
    run_ranks(_scaled, world)
