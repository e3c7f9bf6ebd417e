"""The overlap report, trace and sweep on pycomm's real reducer, 2 Gloo ranks."""

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pycomm
from multirank import run_ranks
from pycomm.overlap import StepReport

SLEEP_S = 0.25


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: compute that leaves the cores free, so a collective
    launched before it has the machine to itself."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP_S)
        return grad


class _SlowFirstLayer(nn.Module):
    """Backward computes the big last layer first (its buckets launch), then the slow first
    layer: the communication hides behind it."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.last = nn.Linear(64, 1 << 16)  # 4M parameters, 16 MiB of gradient

    def forward(self, x):
        return self.last(_SlowBackward.apply(self.first(x)))


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
    torch.manual_seed(0)
    hidden = pycomm.DistributedDataParallel(_SlowFirstLayer(), bucket_cap_mb=1)
    _train(hidden, 3)
    r = hidden.last_step_report()
    _check_invariants(r, _grad_bytes(hidden.module))
    # The 16 MiB of the last layer (about 15 ms on an idle machine, 100 ms on a loaded one)
    # travel during the 250 ms sleep; only the first layer's 4 KiB bucket, launched after
    # it, is exposed: Gloo's latency plus however far the other rank lags.
    big, small = r.buckets
    assert big.nbytes > 1 << 24 and big.exposed_s == 0 and big.done_s < r.compute_s, r
    assert r.exposed_comm_s == small.exposed_s, r
    assert r.overlap > 0.5, r
    one_bucket = pycomm.DistributedDataParallel(_SlowFirstLayer(), bucket_cap_mb=1024)
    _train(one_bucket, 3)
    r = one_bucket.last_step_report()
    _check_invariants(r, _grad_bytes(one_bucket.module))
    assert len(r.buckets) == 1
    # The single bucket completes with the last gradient: nothing can hide.
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
