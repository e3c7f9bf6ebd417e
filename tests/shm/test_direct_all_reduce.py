"""pycomm.shm.all_reduce, the direct all-reduce (Note [Inline all-reduce] in
csrc/shm/backend.cpp), and the futures made on request (Note [Lazy future] in
csrc/shm/work.cpp). The oracle is dist.all_reduce on the same group. Data is
integer-valued, so every result is exact (bit-equal) whatever the order of the sums."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

import pycomm
from tests.support.multirank import run_ranks

_SUM, _MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


def _data(rank, numel, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(7919 * rank + numel + salt)
    return torch.randint(-5, 6, (numel,), generator=g).to(dtype)


def _same_as_dist(rank, world):
    # Both all-reduce paths (one phase up to 256 KiB, pipelined above), dtypes, ops, a
    # non-contiguous tensor, and a Gloo group (where it is dist.all_reduce itself).
    gloo = dist.new_group(backend="gloo")
    for group in (None, gloo):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for numel in (1, 1000, (256 << 10) // dtype.itemsize + 1, 300_001):
                for op in (_SUM, _MAX):
                    x = _data(rank, numel, dtype)
                    want = x.clone()
                    dist.all_reduce(want, op=op, group=group)
                    pycomm.shm.all_reduce(x, op=op, group=group)
                    assert torch.equal(x, want), (group, dtype, numel, op)
    x = _data(rank, 64).view(8, 8).t()
    want = x.clone()
    dist.all_reduce(want)
    pycomm.shm.all_reduce(x)
    assert torch.equal(x, want)
    with pytest.raises(ValueError, match="all_reduce"):
        pycomm.shm.all_reduce(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="all_reduce"):
        pycomm.shm.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG)


def test_direct_all_reduce_matches_dist_all_reduce():
    run_ranks(_same_as_dist, backend="pycomm")


def _after_queued(rank, world):
    # Asynchronous operations still queued: the direct call must take its turn behind them
    # on both ranks. Sizes differ, so a call run out of order would pair a small buffer
    # with a large one and give wrong sums (or time out).
    before = pycomm.shm.stats()
    bigs = [_data(rank, 600_000, salt=i) for i in range(3)]
    wants = [big.clone() for big in bigs]
    small = _data(rank, 7, salt=9)
    want_small = small.clone()
    for w in wants:
        dist.all_reduce(w)
    dist.all_reduce(want_small)
    works = [dist.all_reduce(b, async_op=True) for b in bigs]
    pycomm.shm.all_reduce(small)
    assert torch.equal(small, want_small)
    for work, big, want in zip(works, bigs, wants):
        work.wait()
        assert torch.equal(big, want)
    after = pycomm.shm.stats()
    ran = sum(after[k] - before[k] for k in ("ops_on_caller_thread", "ops_on_worker_thread"))
    assert ran == 2 * (len(bigs) + 1)  # oracles, async ops and the direct call: once each


def test_direct_all_reduce_keeps_issue_order_behind_async_ops():
    run_ranks(_after_queued, backend="pycomm")


def _threads(rank, world):
    # Several groups, each driven by its own thread with direct calls, while the main
    # thread runs dist.all_reduce on the world group: every result exact.
    groups = [dist.new_group(backend="pycomm") for _ in range(2)]
    errors = []

    def drive(group, salt):
        try:
            for i in range(200):
                x = torch.full((5,), float(rank + salt + i))
                pycomm.shm.all_reduce(x, group=group)
                assert torch.all(x == 2 * (salt + i) + 1), (salt, i, x)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(g, 10 * k)) for k, g in enumerate(groups)]
    for t in threads:
        t.start()
    for i in range(200):
        x = torch.full((3,), float(rank * i))
        dist.all_reduce(x)
        assert torch.all(x == i)
    for t in threads:
        t.join()
    assert not errors, errors


def test_direct_all_reduce_from_threads_on_several_groups():
    run_ranks(_threads, backend="pycomm")


def _futures(rank, world):
    # A future asked for before the operation ends, and after it ended (twice).
    x = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    early = work.get_future()
    seen = []
    early.then(lambda f: seen.append(f.value()[0].sum().item()))
    work.wait()
    assert torch.equal(early.wait()[0], torch.full((4,), 3.0)) and seen == [12.0]
    y = torch.full((4,), 1.0)
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    late = work.get_future()
    assert late.done() and torch.equal(late.value()[0], torch.full((4,), 2.0))
    assert torch.equal(work.get_future().wait()[0], torch.full((4,), 2.0))
    dist.all_reduce(torch.ones(1))  # the group still works in step


def test_futures_made_on_request_complete_like_eager_ones():
    run_ranks(_futures, backend="pycomm")


def _peer_never_comes(rank, world):
    if rank == 1:
        time.sleep(3.5)  # past the group's timeout
        return
    with pytest.raises(dist.DistBackendError,
                       match=r"pycomm all_reduce .*Timed out after 2000 ms waiting for rank 1"):
        pycomm.shm.all_reduce(torch.ones(3))
    with pytest.raises(dist.DistBackendError, match="unusable after an earlier failure"):
        pycomm.shm.all_reduce(torch.ones(3))


def test_direct_all_reduce_fails_like_dist_all_reduce():
    run_ranks(_peer_never_comes, backend="pycomm", group_timeout_s=2.0)
