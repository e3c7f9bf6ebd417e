"""The "pycomm" backend when things go wrong: a rank that dies mid-collective, a rank that
never arrives, ranks on two hosts, unsupported arguments. Nothing may hang, errors name
the operation and the rank, and /dev/shm keeps nothing of ours."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import pycomm.shm
from tests.support.multirank import exit_rank, run_ranks

_TIMEOUT_S = 3.0


def _our_segments(pid_file):
    with open(pid_file) as f:
        pid = f.read().strip()
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"pycomm-{pid}-")]


def _dies_mid_collective(rank, world, pid_file, numel):
    if rank == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    dist.all_reduce(torch.ones(10))  # a healthy collective first
    assert not _our_segments(pid_file), "the segment must be unlinked once all ranks mapped it"
    big = torch.ones(numel)
    if rank == 1:
        dist.all_reduce(big, async_op=True)
        time.sleep(0.002)
        exit_rank()
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"pycomm all_reduce .*rank 1 exited"):
        dist.all_reduce(big)
        dist.all_reduce(big)  # the one-phase path: rank 1 may have finished the first
    # Liveness is checked every 20 ms: far sooner than the group timeout.
    assert time.monotonic() - start < _TIMEOUT_S / 2
    with pytest.raises(dist.DistBackendError, match="unusable after an earlier failure"):
        dist.barrier()


# 64 MiB: the pipelined all-reduce; 1000 elements: the one-phase path, run on the calling
# thread (See Note [All-reduce paths] and Note [Waiting helps]).
@pytest.mark.parametrize("world_size, numel", [(2, 64 << 20 >> 2), (3, 64 << 20 >> 2),
                                               (2, 1000), (4, 1000)])
def test_rank_exiting_mid_collective(world_size, numel, tmp_path):
    pid_file = str(tmp_path / "pid")
    run_ranks(_dies_mid_collective, world_size=world_size, backend="pycomm",
              group_timeout_s=_TIMEOUT_S * 4, pid_file=pid_file, numel=numel)
    assert not _our_segments(pid_file)


def _never_arrives(rank, world):
    if rank == 1:
        time.sleep(_TIMEOUT_S + 1.5)
        return
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError,
                       match=r"pycomm broadcast .*Timed out after 3000 ms waiting for rank 1"
                       ) as raised:
        dist.broadcast(torch.ones(3), src=0)
    assert _TIMEOUT_S - 0.1 < time.monotonic() - start < _TIMEOUT_S + 1.0
    # torch's tests and tools recognize a timeout by " Timed out " in the message
    assert " Timed out " in str(raised.value), raised.value


def test_missing_rank_times_out_naming_it():
    run_ranks(_never_arrives, world_size=2, backend="pycomm", group_timeout_s=_TIMEOUT_S)


def _two_hosts(rank, world):
    # Ranks on two hosts make a hierarchical group, not a shared-memory one (hosts holding
    # different numbers of ranks are refused: tests/shm/test_hierarchical_on_one_host.py).
    if rank == 1:
        pycomm.shm.host_identity = lambda: "elsewhere/boot"
    group = dist.new_group(backend="pycomm")
    assert pycomm.shm.hierarchy(group) == {"host": rank, "hosts": 2, "local_rank": 0,
                                           "ranks_per_host": 1}


def _bad_arguments(rank, world):
    with pytest.raises(ValueError, match="pycomm all_reduce: dtype Bool is not supported"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="BAND/BOR/BXOR need an integer dtype, got Float"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="AVG needs a floating dtype"):
        dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG)
    dist.barrier()  # argument errors leave the group usable


def _refusals(rank, world):
    _two_hosts(rank, world)
    dist.barrier()


def test_two_hosts_hierarchical_and_bad_arguments_named():
    run_ranks(_refusals, world_size=2, backend="pycomm")
    run_ranks(_bad_arguments, world_size=2, backend="pycomm")
