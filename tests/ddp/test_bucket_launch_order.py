"""Buckets launch during backward, in order, whatever order the gradients become ready in
(a rank-dependent ready order still reduces correctly: Note [Bucket order]); the timeline
records it; the per-bucket callbacks run before each launch and after each reduction."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm.objects import all_gather_object
from tests.support.ddp_models import assert_same, make_input
from tests.support.multirank import run_ranks

TIMELINE_KEYS = {"step", "rank", "backward_start_ns", "param_ready_ns", "param_names",
                 "buckets", "finalize_start_ns", "finalize_end_ns", "manual_finalization"}
BUCKET_KEYS = {"index", "nbytes", "param_indices", "ready_ns", "launch_ns", "done_ns",
               "in_place"}


class TwoBranch(nn.Module):
    """Two independent branches; the rank decides which one autograd meets first."""

    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.right = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        # The engine runs the most recently created branch first.
        if dist.get_rank() % 2 == 0:
            a = self.left(x)
            b = self.right(x)
        else:
            b = self.right(x)
            a = self.left(x)
        return a + b


def _check_timeline(ddp, steps):
    tls = ddp.timelines(steps)
    assert [t["step"] for t in tls] == list(range(steps))
    for t in tls:
        assert set(t) == TIMELINE_KEYS and all(set(b) == BUCKET_KEYS for b in t["buckets"])
        assert len(t["param_ready_ns"]) == len(t["param_names"]) >= len(t["buckets"]) > 2
        last_ready = max(t["param_ready_ns"])
        launches = [b["launch_ns"] for b in t["buckets"]]
        # Overlap, from the first step on: a bucket's collective starts before the step's
        # last gradient is ready.
        assert launches[0] < last_ready, t
        # See Note [Bucket order]: launched in index order.
        assert launches == sorted(launches)
        for b in t["buckets"]:
            assert b["ready_ns"] <= b["launch_ns"] <= b["done_ns"] <= t["finalize_end_ns"]
        assert t["backward_start_ns"] <= min(t["param_ready_ns"])
    return tls


def _overlap_order_callbacks(rank, world_size):
    torch.manual_seed(0)
    base = TwoBranch()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=1e-6)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6)
    seen_pre, seen_done = {}, {}
    ours.reducer.add_pre_launch(lambda i, buf: seen_pre.__setitem__(i, buf.clone()))
    ours.reducer.add_post_done(lambda i, buf: seen_done.__setitem__(i, buf.clone()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        x = make_input("mlp", rank, step)
        for m, o in zip((ref, ours), opts):
            o.zero_grad()
            m(x).square().mean().backward()
        assert_same(ref, ours, f"two-branch step {step}", exact=True)
        params = [p for _, p in ours.module.named_parameters()]
        for i, members in enumerate(ours.reducer.bucket_indices()):
            reduced = torch.cat([params[j].grad.flatten() for j in members])
            assert torch.equal(seen_done[i], reduced), f"post_done of bucket {i}"
            assert seen_pre[i].shape == reduced.shape
        for o in opts:
            o.step()
    tls = _check_timeline(ours, 3)
    # The ready order really differed between ranks (else this test proves nothing).
    order = sorted(range(len(tls[1]["param_ready_ns"])), key=lambda i: tls[1]["param_ready_ns"][i])
    orders = all_gather_object(order)
    assert orders[0] != orders[1], orders


def test_buckets_launch_during_backward_in_order_with_rank_dependent_ready_order():
    run_ranks(_overlap_order_callbacks, 2)
