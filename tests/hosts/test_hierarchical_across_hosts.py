"""The hierarchical all-reduce across real hosts (network namespaces, pycomm/testing/hosts.py):
what crosses the link, counted on the hosts' interfaces, against the flat Gloo
all-reduce; pycomm's DDP on it by default, against torch's DDP.

Bytes: an all-reduce of S bytes over H hosts of L ranks. Hierarchical: each host's L ranks
each all-reduce S/L bytes with one rank per other host, so a host sends 2(H-1)/H x S.
Flat Gloo ring over n = H x L ranks (ranks host by host): each host's last rank sends
2(n-1)/n x S to the next host's first, so a host sends 2(n-1)/n x S (1.5 S at 2 x 2,
against S). Counted bytes include TCP/IP/Ethernet headers, Gloo's message headers and
the ACKs a host sends for what it receives: hence the 5% margin.

A rank that skips a backward makes every rank of both hosts raise at the next step's first
bucket: each step's label is exchanged over the hierarchical group (Note [Step labels over
the group] in csrc/comm/step_label.cpp)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
import pycomm.shm
from pycomm.testing.hosts import Hosts
from tests.support.ddp_models import build, loss_of, make_input, train_against
from tests.support.hosts_fixture import needs_hosts, nothing_left_behind  # noqa: F401

pytestmark = needs_hosts

NUMEL = 4 << 20  # 16 MiB of float32: headers stay a small share
REPS = 3


def _allreduce(rank, world_size, hierarchical):
    group = (pycomm.shm.hierarchical_group(dist.group.WORLD) if hierarchical
             else dist.group.WORLD)
    assert group is not None
    x = torch.full((NUMEL,), float(rank + 1))
    dist.all_reduce(x, group=group)  # warm-up: connections made, buffers sized
    dist.barrier()
    results = []
    for _ in range(REPS):
        x = torch.arange(NUMEL, dtype=torch.float32) % 251 + rank
        dist.all_reduce(x, group=group)
        results.append(x)
    # Exact: small integers in float32.
    expected = (torch.arange(NUMEL, dtype=torch.float32) % 251) * world_size + sum(
        range(world_size))
    assert all(torch.equal(r, expected) for r in results)
    info = pycomm.shm.hierarchy(group) if hierarchical else None
    dist.barrier()
    return info


def _measure(hosts: Hosts, hierarchical: bool) -> list[int]:
    """Bytes each host sent for REPS all-reduces (the warm-up and barriers subtracted by
    measuring around a whole run: rendezvous and barriers are a few KB)."""
    before = hosts.tx_bytes()
    values = [r.value for r in hosts.run(_allreduce, ranks_per_host=2, timeout=240,
                                         group_timeout_s=120,
                                         kwargs={"hierarchical": hierarchical})]
    after = hosts.tx_bytes()
    if hierarchical:
        assert [v["host"] for v in values] == [0, 0, 1, 1]
        assert [v["local_rank"] for v in values] == [0, 1, 0, 1]
    return [a - b for a, b in zip(after, before)]


def test_hierarchical_sends_fewer_bytes_across_hosts():
    with Hosts(2) as hosts:
        hier = _measure(hosts, hierarchical=True)
        flat = _measure(hosts, hierarchical=False)
    size = NUMEL * 4
    per_call = REPS + 1  # and the warm-up
    hosts_n, world = 2, 4
    hier_bound = 2 * (hosts_n - 1) / hosts_n * size * per_call
    flat_ring = 2 * (world - 1) / world * size * per_call
    report = (f"per host, {per_call} all-reduces of {size} B: hierarchical {hier} "
              f"(bound {hier_bound:.0f} + 5%), flat {flat} (ring {flat_ring:.0f})")
    print(report)
    assert all(b <= hier_bound * 1.05 for b in hier), report
    # The flat ring really sends more across: 1.5x the hierarchical bound at 2 x 2.
    assert all(b >= flat_ring * 0.95 for b in flat), report


def _scatter_gather(rank, world_size, hierarchical):
    """A reduce_scatter_tensor and an all_gather_into_tensor of NUMEL elements, in place
    as the sharded optimizer runs them, REPS + 1 times (the first warms up)."""
    group = (pycomm.shm.hierarchical_group(dist.group.WORLD) if hierarchical
             else dist.group.WORLD)
    s = NUMEL // world_size
    for _ in range(REPS + 1):
        x = torch.arange(NUMEL, dtype=torch.float32) % 251 + rank
        mine = x[rank * s:(rank + 1) * s]
        dist.reduce_scatter_tensor(mine, x, group=group)
        expected = (torch.arange(NUMEL, dtype=torch.float32) % 251) * world_size + sum(
            range(world_size))
        assert torch.equal(mine, expected[rank * s:(rank + 1) * s])  # small integers: exact
        dist.all_gather_into_tensor(x, mine, group=group)
        assert torch.equal(x, expected)
    dist.barrier()


def test_hierarchical_reduce_scatter_and_all_gather_send_an_all_reduce_s_bytes():
    """Note [Hierarchical reduce-scatter and all-gather] in csrc/shm/hier.h: each crosses
    with (H-1)/H of the tensor out of each host, so the pair sends what one hierarchical
    all-reduce sends; flat Gloo sends (n-1)/n over each boundary for the all-gather, and
    its reduce-scatter is one all-reduce per rank."""
    def measure(hosts, hierarchical):
        before = hosts.tx_bytes()
        hosts.run(_scatter_gather, ranks_per_host=2, timeout=240, group_timeout_s=120,
                  kwargs={"hierarchical": hierarchical})
        return [a - b for a, b in zip(hosts.tx_bytes(), before)]

    with Hosts(2) as hosts:
        hier = measure(hosts, hierarchical=True)
        flat = measure(hosts, hierarchical=False)
    size, per_call = NUMEL * 4, REPS + 1
    bound = 2 * (2 - 1) / 2 * size * per_call  # (H-1)/H x S each way, H = 2
    report = f"per host, {per_call} pairs of {size} B: hierarchical {hier} (bound " \
             f"{bound:.0f} + 5%), flat {flat}"
    print(report)
    assert all(b <= bound * 1.05 for b in hier), report
    assert all(b >= 2 * bound for b in flat), report  # 2.25x measured at 2 x 2


def _ddp_hierarchical(rank, world_size, steps=3):
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base))  # default: hierarchical
    # Each element: (its host's two ranks added) + (the other host's), against Gloo's ring
    # order over four ranks: fp32 rounding only (assert_same's 1e-5).
    train_against(ref, ours, rank, steps, exact=False)
    return pycomm.shm.hierarchy(ours.gradient_group)


def test_ddp_reduces_hierarchically_across_hosts():
    with Hosts(2) as hosts:
        values = [r.value for r in hosts.run(_ddp_hierarchical, ranks_per_host=2,
                                             timeout=180, group_timeout_s=60)]
    assert values == [{"host": r // 2, "hosts": 2, "local_rank": r % 2, "ranks_per_host": 2}
                      for r in range(4)]


def _skips_a_backward(rank, world_size, lagging):
    ddp = pycomm.DistributedDataParallel(build("mlp"), bucket_cap_mb=1e-3)
    assert pycomm.shm.hierarchy(ddp.gradient_group) is not None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        for step in range(3):
            if rank == lagging and step == 1:
                ddp(make_input("mlp", rank, 99))  # a forward with grad enabled, no backward
            opt.zero_grad()
            loss_of(ddp(make_input("mlp", rank, step))).backward()
            opt.step()
    return str(raised.value), time.monotonic() - start


def test_a_rank_that_skips_a_backward_fails_every_rank_across_hosts():
    with Hosts(2) as hosts:
        results = [r.value for r in hosts.run(_skips_a_backward, ranks_per_host=2,
                                              timeout=120, group_timeout_s=60,
                                              kwargs={"lagging": 3})]
    for rank, (said, elapsed) in enumerate(results):
        assert "are in different collectives" in said, (rank, said)
        # every rank names the lagging one (and itself): after 2 forwards against 1
        assert "rank 3 is at bucket 0" in said or "rank 3 at bucket 0" in said, (rank, said)
        assert "after 2 forward(s)" in said and "after 1 forward(s)" in said, (rank, said)
        assert elapsed < 20, (rank, elapsed)  # at that bucket, not at the group timeout


def test_collectives_benchmark_measures_the_hierarchy(tmp_path):
    """`pycomm-bench collectives --backend pycomm` across hosts: the "pycomm" world group is
    the hierarchical one, checked on exact data by the benchmark itself."""
    import json
    import sys

    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pycomm.bench", "collectives", "all_reduce", "--backend",
           "pycomm", "-b", "1K", "-e", "4M", "-f", "64", "-w", "1", "-n", "3", "--json",
           str(report)]
    with Hosts(2) as hosts:
        results = hosts.run(cmd, ranks_per_host=2, timeout=180)
    out = results[0].stdout
    assert "# Out of bounds values : 0 OK" in out and "world 4" in out, out
    assert "backend pycomm" in out, out
    rows = json.loads(report.read_text())
    assert rows
