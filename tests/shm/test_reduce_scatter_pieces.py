"""The "pycomm" backend's reduce-scatter of pieces (Note [Pieces reduce-scatter] in
csrc/shm/collectives.cpp), the path of a sharded optimizer's buckets reduced where their
gradients are: several tensors reduce-scattered as one buffer, each rank's elements scaled
as they are read, the tail (the last n mod world elements) all-reduced after the ranges.
Bit for bit what reduce_scatter_tensor and all_reduce of the same buffer pre-scaled with
torch give, across round boundaries and slot reuse, at 2 and 3 ranks; mixable with those
on other ranks; the pieces are only read; bad arguments raise before anything is queued."""

import pytest
import torch
import torch.distributed as dist

from tests.shm.test_allreduce_paths import SLOT_BYTES, SLOTS
from tests.shm.test_allreduce_pieces import _backend, _pieces, assert_in_step
from tests.support.multirank import run_ranks


def _expected(pieces, scale, rank, world):
    """The bucket path: the reducer's pre-scaled copy, reduce_scatter_tensor of the ranges,
    all_reduce of the tail, the rank's range and the tail back to back."""
    flat = torch.mul(torch.cat(pieces), scale)
    s = flat.numel() // world
    mine = torch.empty(s, dtype=flat.dtype)
    if s:
        dist.reduce_scatter_tensor(mine, flat[:world * s])
    tail = flat[world * s:].clone()
    if tail.numel():
        dist.all_reduce(tail)
    return torch.cat([mine, tail])


def _against_the_bucket_path(rank, world):
    per_round = SLOT_BYTES // world // 4  # float32 elements of a range per round
    sizes = [1, world - 1, world, 1000 * world + world - 1, per_round * world,
             (per_round + 3) * world + 1, (SLOTS + 2) * per_round * world + 17]
    for salt, total in enumerate(sizes):
        for scale in (1.0 / world, 1.0, 0.3):
            pieces = _pieces(rank, total, torch.float32, salt)
            before = [p.clone() for p in pieces]
            want = _expected(pieces, scale, rank, world)
            out = torch.full_like(want, float("nan"))
            _backend().reduce_scatter_pieces(pieces, scale, out)
            assert torch.equal(out, want), (total, scale)
            assert all(torch.equal(p, b) for p, b in zip(pieces, before)), "pieces written"
    for total in (777, 3 * SLOT_BYTES // 8 + 5):
        pieces = _pieces(rank, total, torch.float64, total)
        want = _expected(pieces, 1.0 / world, rank, world)
        out = torch.empty_like(want)
        _backend().reduce_scatter_pieces(pieces, 1.0 / world, out)
        assert torch.equal(out, want), total


def _mixed_with_the_bucket_path(rank, world):
    """Rank 0 reduce-scatters pieces while the others take the bucket path: the same two
    collectives, the same result as when every rank takes the bucket path."""
    for total in (513 * world + 1, 3 * SLOT_BYTES // 4 + 1):
        pieces = _pieces(rank, total, torch.float32, 99)
        want = _expected(pieces, 1.0 / world, rank, world)  # every rank on the bucket path
        if rank == 0:
            got = torch.empty_like(want)
            _backend().reduce_scatter_pieces(pieces, 1.0 / world, got)
        else:
            got = _expected(pieces, 1.0 / world, rank, world)
        assert torch.equal(got, want), total


def _bad_arguments(rank, world):
    b = _backend()
    x = torch.zeros(64)
    n = 8 * world + 1
    cases = [
        ([], torch.zeros(1), "no tensors"),
        ([torch.zeros(8, dtype=torch.int64)], torch.zeros(8), "float32 or float64"),
        ([torch.zeros(n)], torch.zeros(n), f"a contiguous Float tensor of 9 elements \\({n} "),
        ([torch.zeros(n)], torch.zeros(9, dtype=torch.float64), "got a Double tensor of 9"),
        ([torch.zeros(n)], torch.zeros(18)[::2], "not contiguous"),
        ([x[:n]], x[n - 9:n], "the output shares memory with an input"),
    ]
    for tensors, out, words in cases:
        with pytest.raises(ValueError, match=words):
            b.reduce_scatter_pieces(tensors, 0.5, out)
    assert_in_step(rank, world)


def _all(rank, world):
    _against_the_bucket_path(rank, world)
    _mixed_with_the_bucket_path(rank, world)
    _bad_arguments(rank, world)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_pieces(world_size):
    run_ranks(_all, world_size=world_size, backend="pycomm")
