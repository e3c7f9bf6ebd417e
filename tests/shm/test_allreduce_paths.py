"""The two all-reduce paths of the "pycomm" backend (Note [All-reduce paths] in
csrc/shm/allreduce.cpp) at and around their boundaries, on 2, 3 and 4 ranks, with Gloo as
the oracle: the last size of the one-phase path and the first of the pipelined one, chunk
boundaries, more chunks than slots (slot reuse), parts that are empty or one element,
and operations of either path and of other collectives back to back, blocking and async.
Data is integer-valued, so sums, maxima and minima are exact in any order (bit-equal to
Gloo); only AVG divides, compared within one rounding of the dtype. bfloat16/float16 also
get non-integer data and special values, checked bit for bit against Gloo's float32
all-reduce of the same values, rounded once."""

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import run_ranks

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


def _low_precision_values(rank, numel, dtype):
    """Random values of every magnitude, plus the cases rounding must get right: ties,
    overflow to inf, inf - inf = nan, nan, subnormals (float16) and signed zeros."""
    g = torch.Generator().manual_seed(31 * rank + numel)
    span = 14.0 if dtype == torch.float16 else 60.0
    x = torch.randn(numel, generator=g) * torch.exp2(torch.randint(-8, 8, (numel,),
                                                                   generator=g).float())
    x = x.clamp(-2 ** span, 2 ** span)
    special = torch.tensor([float("inf") if rank % 2 == 0 else -float("inf"), float("nan"),
                            60000.0, 1.5, 2.0 ** -20, -0.0, 2.0 ** -24, 1.0 + 2.0 ** -8])
    x[: special.numel()] = special
    return x.to(dtype)


def _low_precision_rounding(rank, world):
    """bfloat16/float16 reduce in float32, in Gloo's order, and round once, to nearest
    even: bit-equal to Gloo's float32 all-reduce of the widened values, rounded (non-integer
    data, specials), on the one-phase and the pipelined path, for sum and avg."""
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.bfloat16, torch.float16):
        for numel in (1001, 3 * SLOT_BYTES // 2 + 5):
            mine = _low_precision_values(rank, numel, dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                want = mine.float()
                dist.all_reduce(want, op=op, group=gloo)
                want = want.to(dtype)
                x = mine.clone()
                dist.all_reduce(x, op=op)
                same = (x.view(torch.int16) == want.view(torch.int16)) | (x.isnan() & want.isnan())
                assert bool(same.all()), (dtype, numel, op, x[~same][:5], want[~same][:5])


def _paths(rank, world_size):
    _boundaries(rank, world_size)
    _mixed_back_to_back(rank, world_size)
    _low_precision_rounding(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_paths_equal_gloo(world_size):
    run_ranks(_paths, world_size=world_size, backend="pycomm", deadline_s=240)
