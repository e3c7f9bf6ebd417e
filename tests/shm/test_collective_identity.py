"""Ranks that issue different collectives at the same point of a "pycomm" group's order
(See Note [Collective identity] in csrc/shm/collectives.cpp): each rank's round carries
what it is, so every rank raises at that collective, naming both ranks and what each
issued, instead of reducing mismatched data. Labels (a DDP bucket's step) are compared
where both ranks carry one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pycomm
from tests.support.multirank import run_ranks

_LARGE = 300_000  # float32 elements: over the one-round path's 256 KiB, so pipelined


def _backend():
    return pycomm.shm._inline_backend(dist.group.WORLD)


def _both_raise(rank, issue, expected):
    with pytest.raises(dist.DistBackendError) as raised:
        issue(rank)
    said = str(raised.value)
    assert f"ranks {rank} and {1 - rank} are in different collectives" in said, said
    for text in expected[rank]:
        assert text in said, said
    with pytest.raises(dist.DistBackendError, match="unusable"):
        dist.barrier()  # the group failed as after any error


def _sizes_differ(rank, world_size, sizes):
    def issue(r):
        dist.all_reduce(torch.ones(sizes[r]))
    mine, theirs = sizes[rank], sizes[1 - rank]
    _both_raise(rank, issue, {rank: [f"rank {rank} is at all_reduce of {mine} float32 elements",
                                     f"rank {1 - rank} at all_reduce of {theirs} float32"]})


@pytest.mark.parametrize("sizes", [(10, 11), (_LARGE, _LARGE + 1), (10, _LARGE)],
                         ids=["one-round", "pipelined", "one-round-vs-pipelined"])
def test_all_reduces_of_different_sizes_fail_on_both_ranks(sizes):
    run_ranks(_sizes_differ, 2, backend="pycomm", sizes=sizes)


def _kinds_differ(rank, world_size):
    def issue(r):
        if r == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=0)
    _both_raise(rank, issue, {0: ["rank 0 is at all_reduce of 4 float32 elements",
                                  "rank 1 at broadcast of 16 bytes"],
                              1: ["rank 1 is at broadcast of 16 bytes",
                                  "rank 0 at all_reduce of 4 float32 elements"]})


def test_different_collectives_fail_on_both_ranks():
    run_ranks(_kinds_differ, 2, backend="pycomm")


def _labels(rank, world_size):
    backend = _backend()
    for n in (10, _LARGE):  # both paths
        t = torch.full((n,), float(rank + 1))
        backend.allreduce_sum(t, bucket=2, forwards=1, step=5)  # the same label: reduces
        assert torch.equal(t, torch.full((n,), 3.0))
        pieces = [torch.full((n,), float(rank + 1)), torch.full((3,), 1.0)]
        backend.allreduce_pieces(pieces, 0.5, bucket=0, forwards=1, step=5)
        assert torch.equal(pieces[0], torch.full((n,), 1.5)) and torch.equal(
            pieces[1], torch.full((3,), 1.0))
    # A labelled collective paired with an unlabelled one of the same shape (a joined
    # rank's shadow all-reduce) reduces.
    t = torch.ones(6)
    if rank == 0:
        backend.allreduce_sum(t, bucket=0, forwards=1, step=7)
    else:
        dist.all_reduce(t)
    assert torch.equal(t, torch.full((6,), 2.0))

    def issue(r):  # rank 1 one forward ahead: a skipped backward
        backend.allreduce_sum(torch.ones(8), bucket=0, forwards=1 + r, step=3)
    _both_raise(rank, issue, {
        0: ["rank 0 is at bucket 0 of its synchronized step 3, after 1 forward(s)",
            "rank 1 at bucket 0 of its synchronized step 3, after 2 forward(s)",
            "skipped a backward"],
        1: ["rank 1 is at bucket 0 of its synchronized step 3, after 2 forward(s)",
            "rank 0 at bucket 0 of its synchronized step 3, after 1 forward(s)"]})


def test_bucket_labels_are_compared_where_both_ranks_carry_one():
    run_ranks(_labels, 2, backend="pycomm")


def _three_ranks(rank, world_size):
    # One rank out of three differs: every rank raises, each naming a rank that differs
    # from it (rank 2 names rank 0; ranks 0 and 1 name rank 2).
    with pytest.raises(dist.DistBackendError) as raised:
        dist.all_reduce(torch.ones(5 if rank == 2 else 4))
    other = 0 if rank == 2 else 2
    assert f"ranks {rank} and {other} are in different collectives" in str(raised.value)


def test_one_rank_of_three_differs_and_every_rank_raises():
    run_ranks(_three_ranks, 3, backend="pycomm")
