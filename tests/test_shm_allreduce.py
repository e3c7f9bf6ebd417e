"""The two all-reduce paths of the "pycomm" backend (Note [All-reduce paths] in
csrc/shm/allreduce.cpp) at and around their boundaries, on 2, 3 and 4 ranks, with Gloo as
the oracle: the last size of the one-phase path and the first of the pipelined one, chunk
boundaries, more chunks than slots (slot reuse), parts that are empty or one element,
and operations of either path and of other collectives back to back, blocking and async.
Data is integer-valued, so sums, maxima and minima are exact in any order (bit-equal to
Gloo); only AVG divides, compared within one rounding of the dtype."""

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks

# Keep in step with csrc/shm: kWholeReduceBytes (allreduce.cpp), kSlotBytes (backend.cpp),
# kSlotsPerRank (segment.h).
WHOLE_BYTES = 256 << 10
SLOT_BYTES = 512 << 10
SLOTS = 4


def _sizes(elem):
    whole, chunk = WHOLE_BYTES // elem, SLOT_BYTES // elem
    return [whole - 1, whole, whole + 1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3,
            (SLOTS + 2) * chunk + 1, chunk * SLOTS + 7]


def _data(rank, numel, dtype, salt=0):
    g = torch.Generator().manual_seed(7919 * rank + numel + salt)
    return torch.randint(-5, 6, (numel,), generator=g).to(dtype)


def _expect(x, op, gloo):
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.clone()
    dist.all_reduce(wide, op=op, group=gloo)
    return wide.to(x.dtype)


def _boundaries(rank, world):
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in _sizes(dtype.itemsize):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                x = _data(rank, numel, dtype)
                want = _expect(x, op, gloo)
                dist.all_reduce(x, op=op)
                assert torch.equal(x, want), (dtype, numel, op)
    for numel in (WHOLE_BYTES // 8 + 1, 3 * SLOT_BYTES // 8 + 5):
        x = _data(rank, numel, torch.float64)
        want = _expect(x, dist.ReduceOp.SUM, gloo) / world
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        # One rounding of the float64 sum times 1/world.
        torch.testing.assert_close(x, want, rtol=4 * torch.finfo(torch.float64).eps, atol=0)


def _mixed_back_to_back(rank, world):
    """Paths, other collectives and async operations interleaved: a slot one operation
    reads may not be rewritten by the next before every rank is done with it."""
    gloo = dist.new_group(backend="gloo")
    chunk = SLOT_BYTES // 4
    sizes = [3, 5 * chunk + 17, 1000, 2 * chunk, 1, SLOTS * chunk + 1, WHOLE_BYTES // 4 + 1]
    for step in range(3):
        xs = [_data(rank, n, torch.float32, salt=step) for n in sizes]
        wants = [_expect(x, dist.ReduceOp.SUM, gloo) for x in xs]
        works = [dist.all_reduce(x, async_op=True) for x in xs[:3]]
        b = torch.full((chunk + 9,), float(rank))
        works.append(dist.broadcast(b, src=world - 1, async_op=True))
        for x in xs[3:]:
            dist.all_reduce(x)
        for w in works:
            w.wait()
        for x, want, n in zip(xs, wants, sizes):
            assert torch.equal(x, want), (step, n)
        assert torch.all(b == world - 1)


def _paths(rank, world_size):
    _boundaries(rank, world_size)
    _mixed_back_to_back(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_paths_equal_gloo(world_size):
    run_ranks(_paths, world_size=world_size, backend="pycomm", deadline_s=240)
