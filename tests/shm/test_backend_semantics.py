"""The "pycomm" backend beyond plain results: non-contiguous tensors, async ordering and
futures, send/recv, a subgroup beside the world, 256 MiB, torch's DDP on it (Gloo as the
oracle throughout)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm.shm
from tests.support.multirank import run_ranks


def _non_contiguous(rank, world):
    gloo = dist.new_group(backend="gloo")
    for pick in (lambda t: t[:, ::3], lambda t: t.t(), lambda t: t[1::2]):
        base = torch.arange(60, dtype=torch.float32).view(6, 10) * (rank + 1)
        want = pick(base).contiguous()
        dist.all_reduce(want, group=gloo)
        expected = base.clone()
        pick(expected).copy_(want)  # the view changes, the rest of its storage does not
        assert not pick(base).is_contiguous()
        dist.all_reduce(pick(base))
        assert torch.equal(base, expected)
    out = torch.zeros(world, 8)
    outs = [out[r, ::2] for r in range(world)]  # strided views into one buffer
    dist.all_gather(outs, torch.arange(4, dtype=torch.float32) + rank)
    expected = torch.stack([torch.arange(4, dtype=torch.float32) + r for r in range(world)])
    assert torch.equal(out[:, ::2], expected) and not out[:, 1::2].any()
    b = torch.full((5, 4), float(rank)).t()
    dist.broadcast(b, src=world - 1)
    assert torch.equal(b, torch.full((4, 5), float(world - 1)))


def _async_in_order(rank, world):
    tensors = [torch.full((n,), float(rank + 1)) for n in (3, 500_000, 1, 70_000, 0)]
    done = []
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, w in enumerate(works):
        w.get_future().then(lambda fut, i=i: done.append(i))
    for w in reversed(works):
        assert w.wait()
    total = world * (world + 1) / 2
    assert all(torch.all(t == total) for t in tensors)
    assert done == list(range(len(tensors))), done
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    (value,) = fut.wait()
    assert torch.equal(value, torch.full((2,), float(world)))
    assert works[1].is_completed() and works[1].is_success()


def _send_recv(rank, world):
    # A ring, small and over the 256 KiB mailbox, sends posted before receives.
    for numel in (0, 5, 200_001):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        msg = torch.arange(numel, dtype=torch.float64) + rank
        got = torch.empty(numel, dtype=torch.float64)
        if rank % 2 == 0:
            dist.send(msg, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(msg, nxt)
        assert torch.equal(got, torch.arange(numel, dtype=torch.float64) + prv), numel
        # Every rank sends before it receives: sends and receives have their own lanes.
        got = torch.empty(numel, dtype=torch.float64)
        for req in [dist.isend(msg, nxt), dist.irecv(got, prv)]:
            req.wait()
        assert torch.equal(got, torch.arange(numel, dtype=torch.float64) + prv), numel


def _behaviour(rank, world_size):
    _non_contiguous(rank, world_size)
    _async_in_order(rank, world_size)
    _send_recv(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_non_contiguous_async_and_p2p(world_size):
    run_ranks(_behaviour, world_size=world_size, backend="pycomm")


def _coalesced_like_gloo(rank, world):
    """all_reduce_coalesced gives Gloo's answer however its tensors alias (Note [Coalesced
    all-reduce] in csrc/shm/tensor_args.h): one tensor twice (torch's own test input) is
    reduced once, overlapping views as Gloo's flat copy reduces them; a transposed view and
    an empty tensor in place. (torch's all_reduce_coalesced refuses a list of several
    dtypes before any backend sees it.)"""
    gloo = dist.new_group(backend="gloo")

    def lists():
        t = torch.full((5,), float(rank))
        base = torch.arange(20, dtype=torch.float32) * (rank + 1)
        return {"one tensor twice": [t, t], "overlapping views": [base[0:10], base[5:15]],
                "one tensor": [torch.arange(7, dtype=torch.float64) * rank],
                "distinct": [torch.full((3,), float(rank + i)) for i in range(4)]}

    ours, theirs = lists(), lists()
    for name in ours:
        dist.all_reduce_coalesced(ours[name])
        dist.all_reduce_coalesced(theirs[name], group=gloo)
        for a, b in zip(ours[name], theirs[name]):
            assert torch.equal(a, b), f"{name}: {a} against Gloo's {b}"
    assert torch.equal(ours["one tensor twice"][0], torch.full((5,), float(sum(range(world)))))
    m = torch.arange(12, dtype=torch.float32).view(3, 4) + rank
    view, empty = m.t(), torch.zeros(0)
    dist.all_reduce_coalesced([view, empty])
    expected = torch.arange(12, dtype=torch.float32).view(3, 4) * world + sum(range(world))
    assert torch.equal(m, expected) and empty.numel() == 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_coalesced_matches_gloo(world_size):
    run_ranks(_coalesced_like_gloo, world_size=world_size, backend="pycomm")


def _into_tensor_coalesced_like_gloo(rank, world):
    """all_gather_into_tensor and reduce_scatter_tensor under torch's coalescing manager
    (how FSDP2 issues them) reach the backend as one list (Note [Coalesced into-tensor
    collectives] in csrc/shm/backend_tensor_lists.cpp): Gloo's answer on the same inputs,
    entries of several sizes, an empty one, a 2-D output, SUM, AVG and MAX for the
    reduce-scatter; an all-gather of mixed dtypes as each entry gathered alone; a
    mixed-dtype reduce-scatter and a wrong output size are refused by entry, and the group
    goes on."""
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    ins = [torch.randn(7, generator=g), torch.zeros(0), torch.randn(3, 2, generator=g)]
    results = []
    for group in (dist.group.WORLD, gloo):
        outs = [torch.empty(world * 7), torch.empty(0), torch.empty(world * 3, 2)]
        with dist._coalescing_manager(group=group):
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i, group=group)
        results.append(outs)
    for a, b in zip(*results):
        assert torch.equal(a, b), (a, b)
    # Mixed dtypes (Gloo's coalesced path garbles them): each entry as Gloo gathers it alone.
    mixed = [torch.randint(-9, 9, (4,), generator=g), torch.randn(5, generator=g).double()]
    outs = [torch.empty(world * 4, dtype=torch.int64), torch.empty(world * 5, dtype=torch.double)]
    with dist._coalescing_manager(group=dist.group.WORLD):
        for o, i in zip(outs, mixed):
            dist.all_gather_into_tensor(o, i)
    for o, i in zip(outs, mixed):
        alone = torch.empty_like(o)
        dist.all_gather_into_tensor(alone, i, group=gloo)
        assert torch.equal(o, alone), (o, alone)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        g = torch.Generator().manual_seed(10 + rank)
        rs_in = [torch.randint(-50, 50, (world * n,), generator=g).float() for n in (5, 1, 0, 8)]
        results = []
        for group in (dist.group.WORLD, gloo):
            outs = [torch.full((n,), -1.0) for n in (5, 1, 0, 8)]
            with dist._coalescing_manager(group=group):
                for o, i in zip(outs, rs_in):
                    dist.reduce_scatter_tensor(o, i.clone(), op=op, group=group)
            results.append(outs)
        for a, b in zip(*results):
            if op == dist.ReduceOp.AVG:  # pycomm multiplies by 1/world, Gloo divides: an ulp
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
            else:
                assert torch.equal(a, b), (op, a, b)
    pg = dist.group.WORLD
    with pytest.raises(ValueError, match=r"entry 1 is Double, entry 0 is Float"):
        pg.reduce_scatter_tensor_coalesced([torch.empty(2), torch.empty(2, dtype=torch.double)],
                                           [torch.empty(2 * world),
                                            torch.empty(2 * world, dtype=torch.double)])
    with pytest.raises(ValueError, match=r"entry 0 has a Float input of 3 elements"):
        pg.allgather_into_tensor_coalesced([torch.empty(3)], [torch.empty(3)])
    dist.barrier()


def _all_gather_coalesced_like_gloo(rank, world):
    """dist.all_gather_coalesced (a list of lists: outputs[r][i] is rank r's input i) as one
    all-gather: tensors of several shapes, an empty one, complex; a list of the wrong
    length is refused by name."""
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    ins = [torch.randn(1, generator=g), torch.randn(2, 2, generator=g), torch.zeros(0),
           torch.randn(3, generator=g, dtype=torch.cfloat)]
    results = []
    for group in (dist.group.WORLD, gloo):
        outs = [[torch.full_like(t, -1) for t in ins] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins, group=group)
        results.append(outs)
    for mine, theirs in zip(*results):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b), (a, b)
    with pytest.raises(ValueError, match="output list 0 holds 1 tensors for 2 inputs"):
        dist.group.WORLD.allgather_coalesced([[torch.ones(1)]] * world,
                                             [torch.ones(1), torch.ones(1)])
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_coalesced_matches_gloo(world_size):
    run_ranks(_all_gather_coalesced_like_gloo, world_size=world_size, backend="pycomm")


@pytest.mark.parametrize("world_size", [2, 3])
def test_into_tensor_coalesced_match_gloo(world_size):
    run_ranks(_into_tensor_coalesced_like_gloo, world_size=world_size, backend="pycomm")


def _any_source(rank, world):
    """dist.recv without a source (Note [Receiving from any source] in csrc/shm/p2p.cpp):
    rank 0 takes one message from each peer, in whatever order they come, and learns who
    sent each, as on Gloo; a message of another size is refused naming the sender."""
    if rank == 0:
        seen = {}
        for _ in range(world - 1):
            t = torch.empty(1000)
            src = dist.recv(t)
            assert torch.equal(t, torch.full((1000,), float(src))), (src, t[:3])
            seen[src] = True
        assert sorted(seen) == list(range(1, world)), seen
    else:
        dist.send(torch.full((1000,), float(rank)), dst=0)
    # Rank 1's second message only once rank 0 took every first one: sent before, it could
    # be the one an any-source receive of 1000 floats matches (a peer's messages keep their
    # order, messages of different peers do not).
    dist.barrier()
    if rank == 0:
        t = torch.empty(3)
        work = dist.group.WORLD.recv_anysource([t], 0)
        work.wait()
        assert work._source_rank() == 1 and torch.equal(t, torch.arange(3.0))
    elif rank == 1:
        dist.send(torch.arange(3.0), dst=0)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_receive_from_any_source(world_size):
    run_ranks(_any_source, world_size=world_size, backend="pycomm")


def _any_source_times_out(rank, world):
    # (a failed group stays failed, so no barrier after)
    if rank == 0:
        with pytest.raises(dist.DistBackendError, match="Timed out after 1000 ms waiting for a "
                                                         "message from any rank"):
            dist.recv(torch.empty(2))


def test_receive_from_any_source_times_out_naming_it():
    run_ranks(_any_source_times_out, world_size=2, backend="pycomm", group_timeout_s=1.0)


def _objects_and_refusals(rank, world):
    """torch's object collectives run on a pycomm group; several tensors in one call of the
    backend's own API, monitored_barrier and a sparse tensor are refused by name
    (docs/shm-backend.md, Operations)."""
    got = [None] * world
    dist.all_gather_object(got, {"rank": rank, "name": "r" * rank})
    assert got == [{"rank": r, "name": "r" * r} for r in range(world)], got
    objects = [("from", 0), [1, 2]] if rank == 0 else [None, None]
    dist.broadcast_object_list(objects, src=0)
    assert objects == [("from", 0), [1, 2]], objects
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(rank * 10, gathered, dst=0)
    assert rank != 0 or gathered == [r * 10 for r in range(world)], gathered
    out = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(world)] if rank == 0 else None,
                             src=0)
    assert out == [f"to {rank}"], out
    pg = dist.group.WORLD
    with pytest.raises(ValueError, match="pycomm broadcast: expects one tensor per call, got 2"):
        pg.broadcast([torch.ones(2), torch.ones(2)])
    with pytest.raises(ValueError, match="pycomm all_gather: expects one tensor per call, got 2"):
        pg.allgather([[torch.ones(1)] * world] * 2, [torch.ones(1), torch.ones(1)])
    with pytest.raises((ValueError, RuntimeError), match="(?i)gloo"):
        dist.monitored_barrier()
    with pytest.raises(ValueError, match="needs dense CPU tensors, got a Sparse"):
        dist.all_reduce(torch.ones(4).to_sparse())
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_object_collectives_and_refusals(world_size):
    run_ranks(_objects_and_refusals, world_size=world_size, backend="pycomm")


def _under_detail(rank, world):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps a "pycomm" group in its checker
    (Note [Sequence numbers for torch's checks] in csrc/shm/backend.h): the group is made,
    collectives give Gloo's results through it, point-to-point between two of the ranks
    leaves the others' numbering in step, and a collective whose shapes differ across
    ranks is stopped by torch's check with its message, before the backend runs it."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        group = dist.new_group(backend="pycomm")
        gloo = dist.new_group(backend="gloo")
        assert "Wrapper" in type(group._get_backend(torch.device("cpu"))).__name__
        for step in range(3):
            ours, theirs = (torch.arange(6, dtype=torch.float32) * (rank + step) for _ in "ab")
            dist.all_reduce(ours, group=group)
            dist.all_reduce(theirs, group=gloo)
            assert torch.equal(ours, theirs)
            b = torch.full((4,), float(rank))
            dist.broadcast(b, src=world - 1, group=group)
            assert torch.equal(b, torch.full((4,), float(world - 1)))
            gathered = torch.zeros(world * 2)
            dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), group=group)
            assert torch.equal(gathered, torch.arange(world).repeat_interleave(2).float())
            if rank == 0:  # ranks 0 and 1 alone
                dist.send(torch.full((3,), 7.0), 1, group=group)
            elif rank == 1:
                got = torch.zeros(3)
                dist.recv(got, 0, group=group)
                assert torch.equal(got, torch.full((3,), 7.0))
            dist.barrier(group=group)
        with pytest.raises(RuntimeError, match="Detected mismatch between collectives"):
            dist.all_reduce(torch.zeros(3 + rank), group=group)
        dist.destroy_process_group(group)
    finally:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]
        dist.set_debug_level_from_env()


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_detail_debug_mode_wraps_a_pycomm_group(world_size):
    run_ranks(_under_detail, world_size=world_size, backend="gloo")


def _uneven_reduce_scatter(rank, world):
    """reduce_scatter with each rank's output its own size, as Gloo takes it (Note [Uneven
    reduce-scatter] in csrc/shm/backend.cpp): rank j gets j + 2 elements (none for rank 1
    of three), for sum and max, against Gloo on the same inputs; the even case as before."""
    gloo = dist.new_group(backend="gloo")
    sizes = [j + 2 for j in range(world)]
    if world == 3:
        sizes[1] = 0
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        for shape in (sizes, [5] * world):
            g = torch.Generator().manual_seed(rank)
            ins = [torch.randint(-99, 99, (n,), generator=g).float() for n in shape]  # exact sums
            ours, theirs = torch.full((shape[rank],), -1.0), torch.full((shape[rank],), -2.0)
            dist.reduce_scatter(ours, [t.clone() for t in ins], op=op)
            dist.reduce_scatter(theirs, [t.clone() for t in ins], op=op, group=gloo)
            assert torch.equal(ours, theirs), (op, shape, ours, theirs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_reduce_scatter_matches_gloo(world_size):
    run_ranks(_uneven_reduce_scatter, world_size=world_size, backend="pycomm")


def _subgroup_and_world(rank, world):
    sub = dist.new_group([0, 1], backend="pycomm")
    for step in range(20):
        big = torch.full((300_000,), float(rank + step))
        w_world = dist.all_reduce(big, async_op=True)
        if rank < 2:
            small = torch.full((3,), float(rank + 1))
            dist.all_reduce(small, group=sub)
            assert torch.equal(small, torch.full((3,), 3.0))
        w_world.wait()
        assert torch.all(big == sum(range(world)) + world * step)


def test_subgroup_and_world_at_once():
    run_ranks(_subgroup_and_world, world_size=4, backend="pycomm")


def _huge_all_reduce(rank, world):
    n = (256 << 20) // 4
    x = torch.full((n,), float(rank + 1))
    x[::4097] = rank  # a sparse pattern, so misplaced chunks cannot go unnoticed
    dist.all_reduce(x)
    expected = torch.full((n,), float(world * (world + 1) // 2))
    expected[::4097] = world * (world - 1) // 2
    assert torch.equal(x, expected)


def test_all_reduce_256_mib():
    run_ranks(_huge_all_reduce, world_size=2, backend="pycomm")


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def _train(ddp, rank):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def _torch_ddp(rank, world):
    gloo = dist.new_group(backend="gloo")
    # Different seeds per rank: DDP's initial broadcast from rank 0 must make them equal.
    ours = _train(nn.parallel.DistributedDataParallel(_model(rank), bucket_cap_mb=0.01), rank)
    ref = _train(nn.parallel.DistributedDataParallel(_model(rank), process_group=gloo,
                                                     bucket_cap_mb=0.01), rank)
    for a, b in zip(ours, ref):
        # Two ranks: each gradient sum is one fp32 addition, which commutes; bit-exact.
        assert torch.equal(a, b)


def test_torch_ddp_matches_gloo():
    run_ranks(_torch_ddp, world_size=2, backend="pycomm")


def _same_host_groups(rank, world):
    group = pycomm.shm.same_host_group(dist.group.WORLD)
    assert dist.get_backend(group) == "pycomm"
    assert pycomm.shm.same_host_group(dist.group.WORLD) is group  # cached, no new group
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((3,), float(world)))
    pair = dist.new_group([0, 1])
    if rank < 2:  # built by the members only
        t = torch.ones(3)
        dist.all_reduce(t, group=pycomm.shm.same_host_group(pair))
        assert torch.equal(t, torch.full((3,), 2.0))
    if rank == 1:
        pycomm.shm.host_identity = lambda: "elsewhere/boot"
    assert pycomm.shm.same_host_group(dist.new_group()) is None  # two "hosts": keep Gloo


def test_same_host_group_over_gloo():
    run_ranks(_same_host_groups, world_size=3, backend="gloo")


def _groups_made_by_members_only(rank, world):
    pair = dist.new_group([0, 1])
    if rank < 2:  # the pair's "pycomm" group, made by its members while rank 2 makes nothing
        t = torch.ones(3)
        dist.all_reduce(t, group=pycomm.shm.same_host_group(pair))
        assert torch.equal(t, torch.full((3,), 2.0))
    # Every rank must still name later groups alike (See Note [Groups made by their members
    # only] in pycomm/shm.py): a group made by all ranks (torch 2.15 named it apart), then
    # the "pycomm" group over it, made by its members (torch 2.13 named that one apart).
    everyone = dist.new_group()
    t = torch.ones(3)
    dist.all_reduce(t, group=pycomm.shm.same_host_group(everyone))
    assert torch.equal(t, torch.full((3,), float(world)))


def test_groups_made_by_members_only_leave_later_groups_named_alike():
    # Named apart, the ranks wait for each other in the store until its 300 s timeout; the
    # deadline turns that into a failure (the test takes ~3 s on 2 loaded cores).
    run_ranks(_groups_made_by_members_only, world_size=3, backend="gloo", deadline_s=90)
