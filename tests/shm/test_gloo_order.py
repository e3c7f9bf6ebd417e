"""The "pycomm" backend's sums and products carry Gloo's bits at every world size.

Floating-point data of many magnitudes, so the order of the terms shows in the last bits:
every reducing collective on a pycomm group (sums, averages, products) must equal the same
call on a Gloo group of the same ranks bit for bit (Note [Gloo's summation order] in
csrc/shm/sum_order.h). Each run also checks that rank order would differ from Gloo on the
same data from three ranks on, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import run_ranks

# Whole (<= 256 KiB) and pipelined all-reduces, odd sizes, and one past Gloo's 1 MiB
# segment cap at every world size here (more than 2 x 4 MiB of float32), where its chunks
# stop being even thirds or quarters.
SIZES = [5, 1000, 70_001, 2_400_007]


def _data(rank, numel, dtype, salt=0, product=False):
    g = torch.Generator().manual_seed(7919 * rank + numel + salt)
    if product:  # factors near 1: no overflow, every product rounded
        return (1 + torch.rand(numel, generator=g, dtype=torch.float64) / 8).to(dtype)
    scale = 10.0 ** torch.randint(-4, 5, (numel,), generator=g)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def _same(got, want, what):
    assert torch.equal(got, want), (what, (got != want).sum().item(), got.numel())


def _rank_order_differs(rank, world, n, dtype):
    """Whether summing the ranks' data in rank order misses Gloo's bits (it must, at 3+)."""
    xs = [_data(r, n, dtype) for r in range(world)]
    naive = xs[0].clone()
    for x in xs[1:]:
        naive += x
    t = xs[rank].clone()
    dist.all_reduce(t)
    return not torch.equal(naive, t)


def _all_reduce_and_reduce(rank, world, gloo, dtype):
    for n in SIZES:
        for op, product in ((dist.ReduceOp.SUM, False), (dist.ReduceOp.AVG, False),
                            (dist.ReduceOp.PRODUCT, True)):
            x = _data(rank, n, dtype, product=product)
            want, got = x.clone(), x.clone()
            dist.all_reduce(want, op=op, group=gloo)
            dist.all_reduce(got, op=op)
            _same(got, want, ("all_reduce", op, n))
        for root in range(world):
            x = _data(rank, n, dtype, salt=root)
            want, got = x.clone(), x.clone()
            dist.reduce(want, dst=root, group=gloo)
            dist.reduce(got, dst=root)
            if rank == root:
                _same(got, want, ("reduce", root, n))
    parts = [_data(rank, n, dtype, salt=3) for n in (3, 700, 129)]
    want = [p.clone() for p in parts]
    got = [p.clone() for p in parts]
    dist.all_reduce_coalesced(want, group=gloo)
    dist.all_reduce_coalesced(got)
    for g, w in zip(got, want):
        _same(g, w, "all_reduce_coalesced")


def _reduce_scatters(rank, world, gloo, dtype):
    for n in SIZES[:3] + [SIZES[3] // world]:
        x = _data(rank, world * n, dtype, salt=11)
        want, got = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            dist.reduce_scatter_tensor(want, x, op=op, group=gloo)
            dist.reduce_scatter_tensor(got, x, op=op)
            _same(got, want, ("reduce_scatter_tensor", op, n))
        pieces = list(x.chunk(world))
        want, got = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        dist.reduce_scatter(want, pieces, group=gloo)
        dist.reduce_scatter(got, pieces)
        _same(got, want, ("reduce_scatter", n))
    sizes = [2 + 5 * r for r in range(world)]  # a size per rank
    pieces = [_data(rank, s, dtype, salt=s) for s in sizes]
    want, got = torch.empty(sizes[rank], dtype=dtype), torch.empty(sizes[rank], dtype=dtype)
    dist.reduce_scatter(want, pieces, group=gloo)
    dist.reduce_scatter(got, pieces)
    _same(got, want, "reduce_scatter uneven")
    ins = [_data(rank, world * n, dtype, salt=n) for n in (5, 1000, 31)]
    outs = {}
    for name, group in (("gloo", gloo), ("pycomm", None)):
        outs[name] = [torch.empty(i.numel() // world, dtype=dtype) for i in ins]
        with dist._coalescing_manager(group=group):
            for o, i in zip(outs[name], ins):
                dist.reduce_scatter_tensor(o, i, group=group)
    for g, w in zip(outs["pycomm"], outs["gloo"]):
        _same(g, w, "reduce_scatter_tensor coalesced")


def _orders(rank, world):
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.float32, torch.float64):
        _all_reduce_and_reduce(rank, world, gloo, dtype)
        _reduce_scatters(rank, world, gloo, dtype)
    if world >= 3:
        assert _rank_order_differs(rank, world, 70_001, torch.float32)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sums_carry_gloo_bits(world_size):
    run_ranks(_orders, world_size=world_size, backend="pycomm", deadline_s=300)
