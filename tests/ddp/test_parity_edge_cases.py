"""Review cases for pycomm's DDP against torch's DDP (the oracle) on the same seeds and
data: what tests/ddp/test_parity.py does not reach. Cases share spawned runs to stay fast."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import assert_same, loss_of, manual_average
from tests.support.multirank import run_ranks


class Mixed(nn.Module):
    """A bf16 layer between fp32 layers (separate buckets per dtype) and an ignored
    parameter whose value differs by rank (never broadcast)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.c = nn.Linear(8, 4)
        # Frozen: torch 2.13's DDP leaves step 1 unreduced when an ignored parameter
        # requires grad (seen while writing this test), so it would not be a sound oracle.
        self.local = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)).to(self.b.weight.dtype)).float()
        return self.c(h) + self.local


def _pair(rank, **kwargs):
    torch.manual_seed(11 + rank)  # different initial weights per rank: init must broadcast
    base = Mixed()
    with torch.no_grad():
        base.local.fill_(float(rank))
    TorchDDP._set_params_and_buffers_to_ignore_for_model(base, ["local"])
    return TorchDDP(copy.deepcopy(base), **kwargs), pycomm.DistributedDataParallel(
        copy.deepcopy(base), **kwargs)


def _train(rank, pair, steps, zero_every, eval_every):
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in pair]
    for step in range(steps):
        for ddp, opt in zip(pair, opts):
            if step % zero_every == 0:
                opt.zero_grad(set_to_none=True)
            ddp.train(step % eval_every != 1)
            g = torch.Generator().manual_seed(100 * step + rank)
            loss_of(ddp(torch.randn(4, 8, generator=g))).backward()
        assert_same(pair[0], pair[1], f"step {step}", exact=True)
        for opt in opts:
            opt.step()


def _mixed_ignored_accumulate(rank, world_size):
    for as_view in (False, True):
        pair = _pair(rank, gradient_as_bucket_view=as_view, bucket_cap_mb=1e-6)
        assert torch.all(pair[1].module.local == rank), "an ignored parameter was broadcast"
        # grads kept across steps (zero_grad every 2nd step), eval forwards with backward
        _train(rank, pair, steps=4, zero_every=2, eval_every=3)


def test_mixed_dtypes_ignored_params_accumulation_and_eval_backward():
    run_ranks(_mixed_ignored_accumulate, 2, deadline_s=120)


def _join_zero_batches(rank, world_size):
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    pair = (TorchDDP(copy.deepcopy(base), bucket_cap_mb=1e-6),
            pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6))
    steps = 0 if rank == 1 else 3  # rank 1 has no data at all: joins before any step
    for ddp in pair:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        with ddp.join():
            for step in range(steps):
                opt.zero_grad()
                g = torch.Generator().manual_seed(step)
                loss_of(ddp(torch.randn(4, 8, generator=g))).backward()
                opt.step()
    assert_same(pair[0], pair[1], "join with an empty rank", exact=True, grads=False)
    dist.barrier()


def test_join_with_a_rank_that_has_no_batches():
    run_ranks(_join_zero_batches, 2, group_timeout_s=20, deadline_s=60)


def _raise(grad):
    raise RuntimeError("injected failure in backward")


def _failed_backward_then_no_sync(rank, world_size):
    """A backward that fails after buckets launched, then a no_sync forward: the reducer
    drains the launched collectives, whose completion runs Python (torch's allreduce_hook
    chains a Python `then`). Holding the GIL while draining would deadlock."""
    import time

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6)
    ddp.register_comm_hook(None, allreduce_hook)
    handle = ddp.module[0].weight.register_hook(_raise)
    out = ddp(torch.randn(4, 8))
    if rank == 1:
        time.sleep(2)  # rank 0's launched buckets stay pending while it moves on
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "injected failure" in str(e), e
    handle.remove()
    try:
        with ddp.no_sync():
            ddp(torch.randn(4, 8))
    except RuntimeError as e:
        assert "did not receive a gradient" in str(e), e
    ddp.zero_grad()  # the failed backward left some local grads behind
    plain = copy.deepcopy(base)
    for m in (ddp, plain):
        g = torch.Generator().manual_seed(rank)
        loss_of(m(torch.randn(4, 8, generator=g))).backward()
    manual_average(plain)
    assert_same(plain, ddp.module, "the step after a failed backward", exact=True)


def test_failed_backward_then_no_sync_forward_does_not_deadlock():
    run_ranks(_failed_backward_then_no_sync, 2, group_timeout_s=20, deadline_s=40)
