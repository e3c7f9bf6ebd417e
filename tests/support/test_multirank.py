"""The rank launcher itself: a good run, a rank that raises, a rank that dies."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import pycomm._C as _C
from tests.support.multirank import RankFailed, run_ranks


def _cpp_allreduce(rank, world_size):
    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    _C._allreduce_(dist.group.WORLD, t, "sum")
    expected = torch.arange(5, dtype=torch.float32) * sum(range(1, world_size + 1))
    # Small integers in float32 add exactly in any order: bit-exact.
    assert torch.equal(t, expected), (rank, t, expected)
    m = torch.tensor([float(rank)])
    _C._allreduce_(dist.group.WORLD, m, "max")
    assert m.item() == world_size - 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_cpp_allreduce_on_python_group(world_size):
    run_ranks(_cpp_allreduce, world_size=world_size)


def _unknown_op(rank, world_size):
    _C._allreduce_(dist.group.WORLD, torch.ones(1), "median")


def test_cpp_allreduce_unknown_op_names_it():
    with pytest.raises(RankFailed, match="unknown reduce op 'median'"):
        run_ranks(_unknown_op, world_size=2)


def _noop(rank, world_size):
    # A barrier, not nothing: a rank that exits the moment its own init returns can close
    # its Gloo pair while the other rank is still connecting ("Connection closed by peer",
    # seen in a loaded CI run).
    dist.barrier()


@pytest.fixture(scope="module")
def warm_launcher():
    """Start the launcher's forkserver, which imports torch and pycomm (about 13 s on a busy
    machine), before the tests that time how soon a failed run ends: they bound the
    launcher's reaction, not that import."""
    run_ranks(_noop, world_size=2)


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def test_raising_rank_reports_its_traceback(warm_launcher):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 raised.*ValueError: rank one is unhappy"):
        run_ranks(_rank1_raises, world_size=2, group_timeout_s=30)
    assert time.monotonic() - start < 25, "the healthy rank's barrier should be cut short"


def _rank0_exits_hard(rank, world_size):
    if rank == 0:
        os._exit(7)
    dist.barrier()


def test_hard_exit_fails_fast(warm_launcher):
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0 exited with code 7"):
        run_ranks(_rank0_exits_hard, world_size=2, group_timeout_s=30)
    assert time.monotonic() - start < 25


def _sleeps(rank, world_size):
    time.sleep(60)


def test_deadline_kills_a_stuck_run(warm_launcher):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"still running after 3 s"):
        run_ranks(_sleeps, world_size=2, deadline_s=3)
    assert time.monotonic() - start < 15
