"""The overlap report, trace and sweep on pycomm's real reducer, 2 Gloo ranks."""

import functools
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pycomm
from pycomm.overlap import StepReport
from tests.support.multirank import run_ranks

SLEEP_S = 0.25
# How long the slow layer waits at most for the big bucket's collective: only reached when
# that collective cannot complete during backward (it takes 15 ms on an idle machine and
# about 100 ms on a loaded one).
WAIT_BOUND_S = 30.0


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward runs `hold()`: compute that leaves the cores free, so a
    collective launched before it has the machine to itself."""

    @staticmethod
    def forward(ctx, x, hold):
        ctx.hold = hold
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hold()
        return grad, None


class _SlowFirstLayer(nn.Module):
    """Backward computes the big last layer first (its buckets launch), then the slow first
    layer: the communication hides behind it."""

    def __init__(self, hold):
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.last = nn.Linear(64, 1 << 16)  # 4M parameters, 16 MiB of gradient
        self.hold = hold

    def forward(self, x):
        return self.last(_SlowBackward.apply(self.first(x), self.hold))


class _UntilBucketDone:
    """The slow layer's compute, as long as the communication it hides: in step k it lasts
    until bucket `index`'s collective has completed k times (its post_done callback runs
    after the reducer recorded done_ns), WAIT_BOUND_S at most. So the bucket is done before
    the slow layer's gradient is ready however far the other rank lags or the machine is
    loaded, provided the reducer launched it during backward and it progresses while
    backward computes; if not, the wait runs out and is counted."""

    def __init__(self, ddp, index):
        self.index, self.steps, self.completed, self.timeouts = index, 0, 0, 0
        self.cond = threading.Condition()
        ddp.reducer.add_post_done(self._on_done)

    def _on_done(self, index, buffer):
        if index == self.index:
            with self.cond:
                self.completed += 1
                self.cond.notify_all()

    def __call__(self):
        with self.cond:
            self.steps += 1
            if not self.cond.wait_for(lambda: self.completed >= self.steps, WAIT_BOUND_S):
                self.timeouts += 1


def _train(ddp, steps, batch=4, features=16):
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(batch, features)).square().mean().backward()
        opt.step()


def _check_invariants(r: StepReport, grad_bytes: int):
    for b in r.buckets:
        assert b.ready_s <= b.launch_s <= b.done_s, b
    assert 0 <= r.exposed_comm_s <= r.comm_s
    assert 0 <= r.overlap <= 1
    assert r.nbytes == grad_bytes
    assert r.backward_s >= r.compute_s


def _grad_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _overlap_extremes(rank, world_size):
    # Orderings the reducer controls, not shares of wall-clock time: how long a collective
    # takes, and how far the other rank lags, move with the machine's load.
    torch.manual_seed(0)
    hidden = pycomm.DistributedDataParallel(_SlowFirstLayer(hold=None), bucket_cap_mb=1)
    slow = hidden.module.hold = _UntilBucketDone(hidden, index=0)
    _train(hidden, 3)
    r = hidden.last_step_report()
    _check_invariants(r, _grad_bytes(hidden.module))
    big, small = r.buckets
    assert big.nbytes > 1 << 24 and set(small.params) == {"first.weight", "first.bias"}, r
    # The last layer's bucket launched as its gradients landed, before the slow layer's
    # gradient (the step's last) was ready, and completed while that layer computed, on
    # every step: its communication is hidden whole.
    assert slow.timeouts == 0, f"bucket 0 was not done during backward in {slow.timeouts} steps"
    assert big.launch_s < small.ready_s == r.compute_s, r
    assert big.done_s < r.compute_s and big.exposed_s == 0, r
    # Only the first layer's bucket, launched after the last gradient, is exposed.
    assert small.launch_s >= r.compute_s and small.exposed_s == small.comm_s > 0, r
    assert r.exposed_comm_s == small.exposed_s and 0 < r.overlap < 1, r
    one_bucket = pycomm.DistributedDataParallel(
        _SlowFirstLayer(hold=functools.partial(time.sleep, SLEEP_S)), bucket_cap_mb=1024)
    _train(one_bucket, 3)
    r = one_bucket.last_step_report()
    _check_invariants(r, _grad_bytes(one_bucket.module))
    assert len(r.buckets) == 1
    # The single bucket completes with the last gradient, after the slow layer: it launches
    # only then, and nothing can hide.
    assert r.buckets[0].launch_s >= r.compute_s, r
    assert r.comm_s > 0 and r.exposed_comm_s == r.comm_s and r.overlap == 0, r


def test_slow_first_layer_hides_communication_one_bucket_cannot():
    run_ranks(_overlap_extremes, world_size=2)


class _Mlp(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def _every_step(rank, world_size, trace_path):
    torch.manual_seed(0)
    ddp = pycomm.DistributedDataParallel(
        _Mlp(), config=pycomm.DDPConfig(bucket_cap_mb=0.2, timeline_steps=4))
    _train(ddp, 6, features=32)
    reports = ddp.step_reports(100)
    assert [r.step for r in reports] == [2, 3, 4, 5]  # a bounded ring: the last 4 steps
    assert all(r.rank == rank for r in reports)
    for r in reports:
        _check_invariants(r, _grad_bytes(ddp.module))
        assert len(r.buckets) > 1
    assert ddp.last_step_report() == reports[-1]
    written = ddp.export_chrome_trace(trace_path, all_ranks=True)
    assert (written is not None) == (rank == 0)
    dist.barrier()
    doc = json.loads(Path(trace_path).read_text())
    steps = {(e["pid"], e["args"]["step"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert steps == {(p, s) for p in range(world_size) for s in (2, 3, 4, 5)}
    off = pycomm.DistributedDataParallel(_Mlp(), config=pycomm.DDPConfig(record_timeline=False))
    assert off.timelines(10) == []
    _train(off, 1, features=32)
    with pytest.raises(RuntimeError, match="record_timeline=False"):
        off.last_step_report()


def test_reports_hold_on_every_step_trace_gathers_ranks_recording_can_be_off(tmp_path):
    run_ranks(_every_step, world_size=2, trace_path=str(tmp_path / "trace.json"))
