"""The "pycomm" backend's all-reduce of pieces (Note [Pieces all-reduce] in
csrc/shm/allreduce.cpp), the path of DDP buckets reduced in place: several tensors reduced
as one buffer, each rank's elements scaled as they are read. Bit for bit what a one-buffer
all-reduce of the same elements pre-scaled with torch gives, on both paths, across chunk
and part boundaries and slot reuse, at 2 and 3 ranks; mixable with the one-buffer
all-reduce on other ranks; bad arguments raise before anything is queued."""

import pytest
import torch
import torch.distributed as dist

from tests.shm.test_allreduce_paths import SLOT_BYTES, SLOTS, WHOLE_BYTES
from tests.support.multirank import run_ranks


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _pieces(rank, total, dtype, salt):
    """`total` elements of non-integer data cut into pieces of uneven lengths (the same
    cut on every rank), some of one element."""
    g = torch.Generator().manual_seed(1000 * salt + total)
    cuts, left = [], total
    while left:
        n = min(left, int(torch.randint(1, 3, (1,), generator=g)) if len(cuts) % 5 == 0
                else int(torch.randint(1, max(2, total // 3), (1,), generator=g)))
        cuts.append(n)
        left -= n
    data = torch.randn(total, generator=torch.Generator().manual_seed(rank * 7919 + salt))
    return [piece.clone() for piece in data.to(dtype).split(cuts)]


def _expected(pieces, scale):
    flat = torch.mul(torch.cat(pieces), scale)  # the reducer's copy into its bucket
    dist.all_reduce(flat)
    return flat


def _against_one_buffer(rank, world):
    chunk = SLOT_BYTES // 4
    sizes = [1, 1000, WHOLE_BYTES // 4, WHOLE_BYTES // 4 + 1, chunk + 3, 2 * chunk,
             (SLOTS + 2) * chunk + 17]
    for salt, total in enumerate(sizes):
        for scale in (1.0 / world, 1.0, 0.3):
            pieces = _pieces(rank, total, torch.float32, salt)
            want = _expected(pieces, scale)
            _backend().allreduce_pieces(pieces, scale)
            assert torch.equal(torch.cat(pieces), want), (total, scale)
    for total in (777, 3 * SLOT_BYTES // 8 + 5):
        pieces = _pieces(rank, total, torch.float64, total)
        want = _expected(pieces, 1.0 / world)
        _backend().allreduce_pieces(pieces, 1.0 / world)
        assert torch.equal(torch.cat(pieces), want), total


def _dense_but_not_contiguous(rank, world):
    """A transposed (dense) tensor is reduced in its memory order, as a bucket slot with the
    same strides is (the one buffer laid out as the pieces are: where an element sits in
    it decides the order of its terms, Note [Gloo's summation order])."""
    base = torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))
    want = _expected([torch.zeros(3), base.flatten(), torch.zeros(2)], 1.0 / world)[3:33]
    _backend().allreduce_pieces([torch.zeros(3), base.t(), torch.zeros(2)], 1.0 / world)
    assert torch.equal(base.flatten(), want)


def _mixed_with_one_buffer(rank, world):
    """Rank 0 reduces pieces while the others reduce one pre-scaled buffer: one collective,
    the same result everywhere."""
    for total in (513, 3 * SLOT_BYTES // 4 + 1):
        pieces = _pieces(rank, total, torch.float32, 99)
        want = _expected(pieces, 1.0 / world)
        if rank == 0:
            _backend().allreduce_pieces(pieces, 1.0 / world)
            got = torch.cat(pieces)
        else:
            got = torch.mul(torch.cat(pieces), 1.0 / world)
            dist.all_reduce(got)
        assert torch.equal(got, want), total


def _bad_arguments(rank, world):
    b = _backend()
    x = torch.zeros(64)
    cases = [
        ([], "no tensors"),
        ([x[:40], x[30:]], "share memory"),
        ([torch.zeros(8, dtype=torch.int64)], "float32 or float64"),
        ([torch.zeros(8), torch.zeros(8, dtype=torch.float64)], "tensor 1 is Double"),
        ([torch.zeros(8), torch.zeros(8, 8)[:, ::2]], "tensor 1 is not dense"),
        ([torch.zeros(8)._neg_view()], "negated"),
    ]
    for tensors, words in cases:
        with pytest.raises(ValueError, match=words):
            b.allreduce_pieces(tensors, 0.5)
    assert_in_step(rank, world)


def assert_in_step(rank, world):
    """After refused calls: nothing was queued, so the group goes on in step."""
    y = torch.full((5,), float(rank + 1))
    dist.all_reduce(y)
    assert torch.all(y == world * (world + 1) / 2)


def _all(rank, world):
    _against_one_buffer(rank, world)
    _mixed_with_one_buffer(rank, world)
    _dense_but_not_contiguous(rank, world)
    _bad_arguments(rank, world)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_pieces(world_size):
    run_ranks(_all, world_size=world_size, backend="pycomm")
