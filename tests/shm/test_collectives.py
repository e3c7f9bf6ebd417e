"""The "pycomm" shared-memory backend against Gloo as the oracle, on 2, 3 and 4 ranks.

Each spawned run groups many checks: the default group is "pycomm" and a Gloo group over
the same ranks computes the expected result of every call. Data is integer-valued, so
sums, products, maxima and minima are exact in every dtype and order (bit-equal to Gloo);
only AVG divides, and is compared with a tolerance of one rounding of the dtype.
"""

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import run_ranks

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
          torch.int64]
# 0 and 1 element, odd, and one over a 1 MiB slot for every dtype (several rounds, the
# parallel-reduction path, a short last round).
SIZES = [0, 1, 7, 1_100_001]
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}
BITWISE = {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def _data(rank, numel, dtype, low=-3, high=4, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + numel + salt)
    return torch.randint(low, high, (numel,), generator=g).to(dtype)


def _oracle(fn, *tensors, gloo):
    """Run `fn` on Gloo; bf16/fp16 go through float32 (exact on these integers)."""
    wide = [t.float() if t.dtype in (torch.bfloat16, torch.float16) else t.clone()
            for t in tensors]
    fn(*wide, group=gloo)
    return [w.to(t.dtype) for w, t in zip(wide, tensors)]


def _check_all_reduce(rank, world, gloo):
    for dtype in DTYPES:
        for numel in SIZES:
            for name, op in OPS.items():
                # Products of world factors in [-2, 2] stay exact in every dtype.
                low, high = (-2, 3) if name == "product" else (-3, 4)
                x = _data(rank, numel, dtype, low, high)
                (want,) = _oracle(lambda t, group, op=op: dist.all_reduce(t, op=op, group=group), x,
                                  gloo=gloo)
                dist.all_reduce(x, op=op)
                assert torch.equal(x, want), (dtype, numel, name)
            if not dtype.is_floating_point:  # bitwise ops, integers only (as Gloo)
                for name, op in BITWISE.items():
                    x = _data(rank, numel, dtype, -1000, 1000, salt=7)
                    (want,) = _oracle(
                        lambda t, group, op=op: dist.all_reduce(t, op=op, group=group), x,
                        gloo=gloo)
                    dist.all_reduce(x, op=op)
                    assert torch.equal(x, want), (dtype, numel, name)
            if dtype.is_floating_point:
                x = _data(rank, numel, dtype)
                (want,) = _oracle(lambda t, group: dist.all_reduce(t, group=group), x, gloo=gloo)
                dist.all_reduce(x, op=dist.ReduceOp.AVG)
                # One rounding to the dtype after an exact fp32 sum times 1/world.
                tol = torch.finfo(dtype).eps * 4
                torch.testing.assert_close(x.double(), want.double() / world, rtol=tol,
                                           atol=tol)


def _check_rooted(rank, world, gloo):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in SIZES:
            for root in range(world):
                x = _data(rank, numel, dtype, salt=root)
                want = x.clone()
                dist.broadcast(want, src=root, group=gloo)
                dist.broadcast(x, src=root)
                assert torch.equal(x, want), ("broadcast", dtype, numel, root)
                x = _data(rank, numel, dtype, salt=root)
                (want,) = _oracle(
                    lambda t, group, root=root: dist.reduce(t, dst=root, group=group), x,
                    gloo=gloo)
                mine = x.clone()
                dist.reduce(x, dst=root)
                expected = want if rank == root else mine
                assert torch.equal(x, expected), ("reduce", dtype, numel, root)


def _check_gathers(rank, world, gloo):
    for dtype in (torch.float32, torch.float16, torch.int32):
        for numel in SIZES:
            x = _data(rank, numel, dtype)
            want = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(want, x, group=gloo)
            got = [torch.full_like(x, 9) for _ in range(world)]
            dist.all_gather(got, x)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), ("all_gather", numel)
            flat = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(flat, x)
            assert torch.equal(flat, torch.cat(want)), ("all_gather_into_tensor", numel)
            # in place: the input is this rank's block of the output (its own copy skipped)
            flat = torch.full((world * numel,), 9, dtype=dtype)
            flat[rank * numel:(rank + 1) * numel] = x
            dist.all_gather_into_tensor(flat, flat[rank * numel:(rank + 1) * numel])
            assert torch.equal(flat, torch.cat(want)), ("in-place all_gather_into_tensor", numel)
            big = _data(rank, world * numel, dtype, salt=5)
            (want_rs,) = _oracle(lambda t, group: dist.all_reduce(t, group=group), big,
                                 gloo=gloo)
            out = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(out, big)
            assert torch.equal(out, want_rs[rank * numel:(rank + 1) * numel]), ("rs", numel)
            out_list = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter(out_list, list(big.chunk(world)) if numel else
                                [torch.empty(0, dtype=dtype)] * world)
            assert torch.equal(out_list, out), ("reduce_scatter list", numel)


def _check_all_to_all(rank, world, gloo):
    for dtype in (torch.float64, torch.int32, torch.bfloat16):
        for rows in (0, 1, 3, 70_001):
            x = _data(rank, world * rows * 2, dtype).view(world * rows, 2)
            want, got = torch.empty_like(x), torch.full_like(x, 7)
            dist.all_to_all_single(want, x, group=gloo)
            dist.all_to_all_single(got, x)
            assert torch.equal(got, want), ("all_to_all_single", dtype, rows)
        # Uneven splits: rank r sends r + p + 1 rows to rank p (one pair far over a slot).
        send = [rank + p + 1 + (90_000 if (rank, p) == (0, world - 1) else 0)
                for p in range(world)]
        recv = [p + rank + 1 + (90_000 if (p, rank) == (0, world - 1) else 0)
                for p in range(world)]
        x = _data(rank, sum(send), dtype)
        want, got = torch.empty(sum(recv), dtype=dtype), torch.zeros(sum(recv), dtype=dtype)
        dist.all_to_all_single(want, x, recv, send, group=gloo)
        dist.all_to_all_single(got, x, recv, send)
        assert torch.equal(got, want), ("all_to_all_single uneven", dtype)


def _collectives(rank, world_size):
    gloo = dist.new_group(backend="gloo")
    _check_all_reduce(rank, world_size, gloo)
    _check_rooted(rank, world_size, gloo)
    _check_gathers(rank, world_size, gloo)
    _check_all_to_all(rank, world_size, gloo)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_equal_gloo(world_size):
    run_ranks(_collectives, world_size=world_size, backend="pycomm", deadline_s=240)
