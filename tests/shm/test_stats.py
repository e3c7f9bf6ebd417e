"""pycomm.shm.stats(): how the backend's operations ran and how its waits ended. Beyond
the counters themselves, two behaviours they make visible: a blocking call never wakes a
worker thread, and the spin budget recovers after a phase where a peer was late."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import pycomm.shm
from tests.support.multirank import RankFailed, run_ranks


def _blocking_calls_stay_on_the_caller(rank, world):
    before = pycomm.shm.stats()
    t = torch.ones(1)
    for _ in range(300):
        dist.all_reduce(t)
    after = pycomm.shm.stats()
    ran = {k: after[k] - before[k] for k in after if k != "spin_budget_ns"}
    assert ran["ops_on_caller_thread"] == 300 and ran["ops_on_worker_thread"] == 0, ran
    # A worker woken by every blocking call (the bug this guards against) makes 300.
    assert ran["worker_idle_wakeups"] <= 3, ran
    assert ran["waits"] == ran["waits_spun"] + ran["waits_slept"], ran

    works = [dist.all_reduce(torch.ones(1000), async_op=True) for _ in range(20)]
    for w in works:
        w.wait()
    end = pycomm.shm.stats()
    ran_async = (end["ops_on_caller_thread"] + end["ops_on_worker_thread"]
                 - after["ops_on_caller_thread"] - after["ops_on_worker_thread"])
    assert ran_async == 20, (after, end)


# Phase 2 of a try is conclusive only when the two ranks had the cores to themselves: the
# share of its wall time during which some runnable task on the machine waited for a core
# (Linux PSI; None where the kernel does not report it). Quiet, it is near 0; one more
# CPU-bound task than cores makes it near 1 (0.64 to 1.00 measured on a busy machine).
_CONTENDED = "cores contended during phase 2 of every try"
_MAX_CONTENDED = 0.25


def _cpu_wait_us():
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None


def _late_then_lock_step(rank, t):
    # Phase 1: rank 1 arrives 30 ms late ten times; rank 0 spins, gives up and sleeps,
    # and its budget halves each time (from at most the 200 us cap: <= 0.8 us after 8,
    # with two to spare for a call where rank 0 itself was descheduled for 30 ms).
    for _ in range(10):
        if rank == 1:
            time.sleep(0.03)
        dist.all_reduce(t)
    late = pycomm.shm.stats()
    if rank == 0:
        assert late["waits_slept"] >= 8 and late["spin_budget_ns"] <= 1_000, late
    # Phase 2: lock-step calls. The budget must come back, learned from the peer's real
    # arrival times: a budget cut on every failed spin alone stays at 0.5 us for good
    # (no spin that short succeeds) and the ranks then sleep on a large share of calls.
    waited, start = _cpu_wait_us(), time.monotonic_ns()
    for _ in range(400):
        dist.all_reduce(t)
    waited_after, wall_us = _cpu_wait_us(), (time.monotonic_ns() - start) / 1e3
    contended = None if waited is None or waited_after is None else (
        (waited_after - waited) / wall_us)
    return late, pycomm.shm.stats(), contended


def _budget_recovers(rank, world):
    t = torch.ones(1)
    dist.all_reduce(t)
    # Up to three tries: on a loaded machine the peer may truly be late in phase 2 too,
    # and then shrinking the budget is right. Without learning, every try fails.
    contended = []
    for _ in range(3):
        late, end, share = _late_then_lock_step(rank, t)
        contended.append(share)
        ok = torch.tensor([float(end["spin_budget_ns"] >= 10_000)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item():
            return
    quietest = None if None in contended else min(contended)
    where = "" if quietest is None else f"; {_CONTENDED}: {quietest:.0%} or more"
    raise AssertionError(f"spin budget did not recover: {late} -> {end}{where}")


def _refuses_other_backends(rank, world):
    gloo = dist.new_group(backend="gloo")
    with pytest.raises(ValueError, match="uses backend 'gloo', not 'pycomm'"):
        pycomm.shm.stats(gloo)
    assert set(pycomm.shm.stats()) == {
        "ops_on_caller_thread", "ops_on_worker_thread", "worker_idle_wakeups", "waits",
        "waits_spun", "waits_slept", "waits_spun_through_wakeup", "spin_budget_ns"}


def _all(rank, world):
    _refuses_other_backends(rank, world)
    _blocking_calls_stay_on_the_caller(rank, world)
    _budget_recovers(rank, world)


def test_shm_stats():
    try:
        run_ranks(_all, 2, "pycomm", group_timeout_s=30, deadline_s=120)
    except RankFailed as e:
        # Other jobs on the cores delay the peer for real, and a shrinking budget is then
        # the right answer: that case proves nothing either way. A try whose phase 2 had
        # the cores to itself and still did not recover fails the test.
        if "did not recover" in str(e):
            share = re.search(_CONTENDED + r": (\d+)%", str(e))
            if share is not None and int(share.group(1)) > 100 * _MAX_CONTENDED:
                pytest.skip(f"machine loaded: {e}")
            # No pressure figures from this kernel: judge by the load average instead.
            load, cores = os.getloadavg()[0], os.cpu_count() or 1
            if share is None and load > 1.5 * cores:
                pytest.skip(f"machine loaded (load {load:.1f} on {cores} cores): {e}")
        raise
