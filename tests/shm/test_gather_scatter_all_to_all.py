"""gather (into a list and, on torch 2.15, into one tensor), scatter and the list all_to_all
of the "pycomm" backend, with Gloo as the oracle.

One spawned run per world size (2, 3, 4 ranks) groups every check: the default group is
"pycomm" and a Gloo group over the same ranks computes the expected result of each call on
the same inputs. These collectives only move data, so results must be bit-equal in every
dtype. Sizes: 0, 1 and 7 elements and 300,001 (over the 512 KiB slot per rank in float32
and bfloat16, so several rounds and a short last one). Odd roots get non-contiguous inputs
and outputs.
"""

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
SIZES = (0, 1, 7, 300_001)


def _data(rank, numel, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + numel + salt)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def _strided(numel, dtype, fill):
    """A non-contiguous view of `numel` elements (every other element of a buffer)."""
    return torch.full((numel, 2), fill, dtype=dtype)[:, 1]


def _maybe_strided(t, strided):
    if not strided:
        return t
    view = _strided(t.numel(), t.dtype, 0)
    view.copy_(t)
    assert view.numel() <= 1 or not view.is_contiguous()
    return view


def _dense(tensors):
    """What Gloo gets: contiguous copies. Its scatter reads a non-contiguous input's storage
    as if it were contiguous (seen on torch 2.13), so it is no oracle for those."""
    return None if tensors is None else [t.contiguous() for t in tensors]


def _check_gather(rank, world, gloo, dtype, numel, root):
    strided = root % 2 == 1
    x = _maybe_strided(_data(rank, numel, dtype, salt=root), strided)
    want = [torch.empty(numel, dtype=dtype) for _ in range(world)] if rank == root else None
    dist.gather(x.contiguous(), want, dst=root, group=gloo)
    got = None
    if rank == root:
        make = (lambda: _strided(numel, dtype, 9)) if strided else (
            lambda: torch.full((numel,), 9, dtype=dtype))
        got = [make() for _ in range(world)]
    dist.gather(x, got, dst=root)
    if rank == root:
        assert all(torch.equal(a, b) for a, b in zip(got, want)), ("gather", dtype, numel, root)


def _check_scatter(rank, world, gloo, dtype, numel, root):
    strided = root % 2 == 1
    ins = None
    if rank == root:
        ins = [_maybe_strided(_data(p, numel, dtype, salt=7 + root), strided)
               for p in range(world)]
    want = torch.empty(numel, dtype=dtype)
    dist.scatter(want, _dense(ins), src=root, group=gloo)
    got = _strided(numel, dtype, 9) if strided else torch.full((numel,), 9, dtype=dtype)
    dist.scatter(got, ins, src=root)
    assert torch.equal(got, want), ("scatter", dtype, numel, root)


def _check_rooted(rank, world, gloo):
    for dtype in DTYPES:
        for numel in SIZES:
            for root in range(world):
                _check_gather(rank, world, gloo, dtype, numel, root)
                _check_scatter(rank, world, gloo, dtype, numel, root)
    # The root's own output may be its input tensor.
    x = _data(rank, 5, torch.float32)
    outs = [torch.empty(5) for _ in range(world)]
    outs[0] = x if rank == 0 else outs[0]
    want = [torch.empty(5) for _ in range(world)] if rank == 0 else None
    dist.gather(x.clone(), want, dst=0, group=gloo)
    dist.gather(x, outs if rank == 0 else None, dst=0)
    if rank == 0:
        assert all(torch.equal(a, b) for a, b in zip(outs, want)), "gather into its input"
    # Asynchronous: both complete, in issue order, on the caller's wait.
    out = torch.zeros(3)
    w1 = dist.scatter(out, [torch.full((3,), float(p)) for p in range(world)] if rank == 1
                      else None, src=1, async_op=True)
    gathered = [torch.empty(3) for _ in range(world)] if rank == 0 else None
    w2 = dist.gather(out, gathered, dst=0, async_op=True)
    w2.wait()
    w1.wait()
    assert torch.equal(out, torch.full((3,), float(rank)))
    if rank == 0:
        assert torch.equal(torch.stack(gathered), torch.arange(world).float()[:, None].expand(
            world, 3)), "async gather after scatter"


def _a2a_sizes(src, dst, world):
    """Elements rank `src` sends to rank `dst`: 0, 1, odd, and one pair over a slot."""
    return SIZES[(src + 2 * dst) % len(SIZES)] if (src, dst) != (0, world - 1) else 300_001


def _check_all_to_all(rank, world, gloo):
    for dtype in DTYPES:
        # Equal sizes: Gloo's list all_to_all is the oracle (it needs one size per call).
        for numel in SIZES:
            ins = [_maybe_strided(_data(rank, numel, dtype, salt=p), p % 2 == 1)
                   for p in range(world)]
            want = [torch.empty(numel, dtype=dtype) for _ in range(world)]
            dist.all_to_all(want, _dense(ins), group=gloo)
            got = [_strided(numel, dtype, 9) if p % 2 else torch.full((numel,), 9, dtype=dtype)
                   for p in range(world)]
            dist.all_to_all(got, ins)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), ("all_to_all", numel)
        # Sizes per peer: the oracle is Gloo's all_to_all_single on the same data end to end.
        send = [_a2a_sizes(rank, p, world) for p in range(world)]
        recv = [_a2a_sizes(p, rank, world) for p in range(world)]
        ins = [_maybe_strided(_data(rank, n, dtype, salt=p), p % 2 == 0)
               for p, n in enumerate(send)]
        want = torch.empty(sum(recv), dtype=dtype)
        dist.all_to_all_single(want, torch.cat(ins), recv, send, group=gloo)
        got = [_strided(n, dtype, 9) if p % 2 else torch.full((n,), 9, dtype=dtype)
               for p, n in enumerate(recv)]
        dist.all_to_all(got, ins)
        assert torch.equal(torch.cat(got), want), ("all_to_all uneven", dtype)


def _raises(fn, *words):
    with pytest.raises(ValueError) as info:
        fn()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def _check_bad_arguments(rank, world):
    """Each bad call fails on every rank before anything is queued, so none waits."""
    pg = dist.group.WORLD
    x = torch.ones(4)
    five = [torch.empty(4) for _ in range(world + 1)]
    _raises(lambda: dist.gather(x, dst=world), "pycomm gather", f"root {world} is outside")
    _raises(lambda: dist.gather(x, five, dst=rank), "pycomm gather", f"root {rank}",
            f"one list of {world} output")
    _raises(lambda: dist.gather(x, [torch.empty(5) for _ in range(world)], dst=rank),
            "pycomm gather", f"root {rank}", "output tensor 0", "with 5 elements")
    opts = dist.GatherOptions()
    opts.rootRank = rank
    _raises(lambda: pg.gather([[torch.empty(4, dtype=torch.int64)] * world], [x], opts),
            "pycomm gather", "Long", "expected Float")
    opts.rootRank = (rank + 1) % world
    _raises(lambda: pg.gather([[x] * world], [x], opts), "pycomm gather",
            f"rank {rank} is not the root")
    _raises(lambda: dist.scatter(x, src=-1), "pycomm scatter", "root -1 is outside")
    _raises(lambda: dist.scatter(x, five, src=rank), "pycomm scatter", f"root {rank}",
            f"one list of {world} input")
    _raises(lambda: dist.scatter(x, [x] * (world - 1) + [torch.empty(3)], src=rank),
            "pycomm scatter", f"input tensor {world - 1}", "with 3 elements")
    opts = dist.ScatterOptions()
    opts.rootRank = rank
    _raises(lambda: pg.scatter([x], [[x.bfloat16()] * world], opts), "pycomm scatter",
            "BFloat16")
    _raises(lambda: dist.all_to_all([x] * world, five), "pycomm all_to_all",
            f"{world} output and {world} input")
    _raises(lambda: pg.alltoall([x] * world, [x] * (world - 1) + [x.double()],
                                dist.AllToAllOptions()),
            "pycomm all_to_all", f"input tensor {world - 1} is Double")
    dist.barrier()  # the group is still usable


def _gather_single(rank, world):
    """dist.gather_single into one tensor, against Gloo's gather into a list (Gloo has no
    gather into one tensor), stacked: the same bytes in the same order."""
    gloo = dist.new_group(backend="gloo")
    for dtype in DTYPES:
        for numel in SIZES:
            for root in range(world):
                x = _maybe_strided(_data(rank, numel, dtype, salt=3 + root), root % 2 == 1)
                want = ([torch.empty(numel, dtype=dtype) for _ in range(world)]
                        if rank == root else None)
                dist.gather(x.contiguous(), want, dst=root, group=gloo)
                got = torch.full((world, numel), 9, dtype=dtype) if rank == root else None
                dist.gather_single(x, got, dst=root)
                if rank == root:
                    assert torch.equal(got, torch.stack(want)), (dtype, numel, root)
    x = torch.ones(4)
    _raises(lambda: dist.gather_single(x, torch.empty(4 * world + 1), dst=rank),
            "pycomm gather_single", f"of {4 * world} elements, got Float with {4 * world + 1}")
    _raises(lambda: dist.gather_single(x, torch.empty(4, world).t(), dst=rank),
            "pycomm gather_single", f"(root {rank})", "must be contiguous")
    dist.barrier()  # the group is still usable


@pytest.mark.skipif(not hasattr(dist, "gather_single"),
                    reason="torch.distributed has no gather_single (torch 2.15 has)")
@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_single_equals_gloo_gather(world_size):
    run_ranks(_gather_single, world_size=world_size, backend="pycomm", deadline_s=120)


def _collectives(rank, world_size):
    gloo = dist.new_group(backend="gloo")
    _check_rooted(rank, world_size, gloo)
    _check_all_to_all(rank, world_size, gloo)
    _check_bad_arguments(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gather_scatter_all_to_all_equal_gloo(world_size):
    run_ranks(_collectives, world_size=world_size, backend="pycomm", deadline_s=120)
