"""The hierarchical "pycomm" group (csrc/shm/hier.h) on one machine, its ranks told apart
as "hosts" by their host identity (what pycomm.shm reads to decide which ranks share
memory). The same code across real network namespaces:
tests/hosts/test_hierarchical_across_hosts.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.shm
from tests.support.ddp_models import build
from tests.support.gloo_order import ring_sum
from tests.support.multirank import run_ranks


def _pretend_hosts(rank: int, per_host: list[int]) -> None:
    """Rank r's host is the index of the block of `per_host` it falls in."""
    edges, total = [], 0
    for n in per_host:
        total += n
        edges.append(total)
    host = next(h for h, edge in enumerate(edges) if rank < edge)
    pycomm.shm.host_identity = lambda: f"host{host}/boot"


# (dtype, op) pairs the hierarchical collectives are checked with: exact ones (integers,
# max) and float sums and averages in three dtypes.
CASES = [(torch.float32, dist.ReduceOp.SUM), (torch.int64, dist.ReduceOp.SUM),
         (torch.float32, dist.ReduceOp.MAX), (torch.float64, dist.ReduceOp.AVG),
         (torch.bfloat16, dist.ReduceOp.SUM), (torch.int64, dist.ReduceOp.BXOR)]


def _flat_reference(x, op, world):
    """`x` all-reduced with `op` over flat Gloo (WORLD), bf16 widened to float64 first;
    AVG as a sum divided once."""
    flat = x.clone().to(torch.float64) if x.dtype == torch.bfloat16 else x.clone()
    if op == dist.ReduceOp.AVG:
        dist.all_reduce(flat)
        flat /= world
    else:
        dist.all_reduce(flat, op=op)
    return flat


def _sizes():
    # empty, smaller than the ranks of a host, not divisible by them, divisible, larger
    # than the shared segment's slots (512 KiB per round), several rounds.
    return [0, 1, 3, 7, 1024, 300_001]


def _hier_collectives(rank, world, per_host):
    _pretend_hosts(rank, per_host)
    group = pycomm.shm.hierarchical_group(dist.group.WORLD)
    assert group is not None and dist.get_backend(group) == "pycomm"
    info = pycomm.shm.hierarchy(group)
    assert info == {"host": rank // per_host[0], "hosts": len(per_host),
                    "local_rank": rank % per_host[0], "ranks_per_host": per_host[0]}
    assert pycomm.shm.hierarchical_group(dist.group.WORLD) is group  # cached

    for n in _sizes():
        for dtype, op in CASES:
            g = torch.Generator().manual_seed(n * 31 + rank)
            x = (torch.randn(n, generator=g) * 100).to(dtype)
            mine = x.clone()
            dist.all_reduce(mine, op=op, group=group)
            flat = _flat_reference(x, op, world)
            # Integers and max are exact. Floats: the hierarchy adds each host's ranks
            # first, then the hosts; Gloo's flat ring adds in another order: rounding only.
            if dtype in (torch.int64,) or op == dist.ReduceOp.MAX:  # exact
                assert torch.equal(mine, flat), (n, dtype, op)
            else:
                tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(mine.to(flat.dtype), flat, rtol=tol, atol=tol * 100)
            # Every rank holds the same bits.
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            assert all(torch.equal(t, mine) for t in gathered), (n, dtype, op)

    # A non-contiguous tensor, coalesced, and async work in flight at once.
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
    view = base.t()
    dist.all_reduce(view, group=group)
    expected = (torch.arange(24, dtype=torch.float32).reshape(4, 6) * world
                + sum(range(world))).t()
    assert torch.equal(view, expected)
    twice = torch.full((5,), float(rank))  # See Note [Coalesced all-reduce]: reduced once
    dist.all_reduce_coalesced([twice, twice], group=group)
    assert torch.equal(twice, torch.full((5,), float(sum(range(world)))))
    tensors = [torch.full((1000,), float(rank + i)) for i in range(8)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    for i, (w, t) in enumerate(zip(works, tensors)):
        w.wait()
        assert torch.equal(t, torch.full((1000,), float(sum(range(world)) + world * i)))

    # Everything else goes to the group over all ranks.
    t = torch.full((5,), float(rank))
    dist.broadcast(t, src=world - 1, group=group)
    assert torch.equal(t, torch.full((5,), float(world - 1)))
    out = [torch.empty(2) for _ in range(world)]
    dist.all_gather(out, torch.full((2,), float(rank)), group=group)
    assert [o[0].item() for o in out] == list(range(world))
    if hasattr(dist, "gather_single"):  # torch 2.15: into one tensor, the flat gather
        out = torch.full((world, 3), -1.0) if rank == 1 else None
        dist.gather_single(torch.arange(3.0) + 10 * rank, out, dst=1, group=group)
        if rank == 1:
            assert torch.equal(out, torch.arange(3.0) + 10 * torch.arange(world)[:, None])
    dist.barrier(group=group)
    assert pycomm.shm.stats(group)["ops_on_caller_thread"] + \
        pycomm.shm.stats(group)["ops_on_worker_thread"] > 0  # its shared-memory part


@pytest.mark.parametrize("per_host", [[2, 2], [1, 1], [3, 3]], ids=["2x2", "2x1", "2x3"])
def test_hierarchical_allreduce(per_host):
    if per_host == [1, 1]:
        run_ranks(_one_per_host, world_size=2)
        return
    run_ranks(_hier_collectives, world_size=sum(per_host), per_host=per_host)


def _one_per_host(rank, world):
    _pretend_hosts(rank, [1, 1])
    # One rank per host: the flat Gloo all-reduce already is the cross-host one.
    assert pycomm.shm.hierarchical_group(dist.group.WORLD) is None
    assert pycomm.shm.same_host_group(dist.group.WORLD) is None
    # Asked for explicitly, a "pycomm" group over two hosts of one rank still works.
    group = dist.new_group(backend="pycomm")
    assert pycomm.shm.hierarchy(group)["hosts"] == 2
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((3,), 3.0))


def _uneven_hosts(rank, world):
    _pretend_hosts(rank, [2, 1])
    assert pycomm.shm.hierarchical_group(dist.group.WORLD) is None  # DDP keeps Gloo
    layout = r"\(host0/boot: ranks \[0, 1\]; host1/boot: ranks \[2\]\)"
    with pytest.raises(ValueError, match=r"hosts hold different numbers of ranks " + layout):
        dist.new_group(backend="pycomm")


def test_uneven_hosts_are_refused_by_name():
    run_ranks(_uneven_hosts, world_size=3)


def _ddp_hierarchical(rank, world, hierarchical):
    _pretend_hosts(rank, [2, 2])
    torch.manual_seed(0)
    ours = pycomm.DistributedDataParallel(
        build("mlp"),
        config=pycomm.DDPConfig(bucket_cap_mb=0.002, hierarchical_allreduce=hierarchical))
    torch.manual_seed(0)
    ref = torch.nn.parallel.DistributedDataParallel(build("mlp"), bucket_cap_mb=0.002)
    if hierarchical:
        assert pycomm.shm.hierarchy(ours.gradient_group) == {
            "host": rank // 2, "hosts": 2, "local_rank": rank % 2, "ranks_per_host": 2}
    else:
        assert ours.gradient_group is dist.group.WORLD
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(8, 8, generator=g)
        for model in (ours, ref):
            model.zero_grad()
            model(x).pow(2).mean().backward()
        for (name, a), b in zip(ours.module.named_parameters(), ref.module.parameters()):
            # Four float32 terms per element, added in another order: by host, then
            # across hosts (hierarchical), or by Gloo's ring over buckets cut otherwise
            # than torch's (flat; at 2 ranks the one addition is exact in any order).
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("hierarchical", [True, False])
def test_ddp_uses_the_hierarchy(hierarchical):
    run_ranks(_ddp_hierarchical, world_size=4, hierarchical=hierarchical)


def _hierarchical_sum(x_of, ranks, s, piece, wire=None):
    """The float32 reduce-scatter the hierarchy computes, in its order (Note [Hierarchical
    reduce-scatter and all-gather]), every rank's range of `s`, block by block (`piece`
    elements of each range): each host's ranks as its shared-memory reduce-scatter of the
    block's chunks adds them (Gloo's ring order, tests/support/gloo_order.py; local rank k
    keeps chunk k), then the hosts in order. `wire`: what crossing hosts makes of each
    host's sum of a range (a low-precision wire's rounding), the sums still in float32."""
    wire = wire or (lambda t: t)
    H, L = len(ranks), len(ranks[0])
    out = torch.empty(H * L * s)
    for b in range(0, s, piece):
        n = min(piece, s - b)
        within = []  # per host: its reduce-scatter's result, chunk l for local rank l
        for h in range(H):
            bufs = [torch.cat([x_of[ranks[h][mine]][r * s + b:r * s + b + n]
                               for r in (ranks[hh][k] for k in range(L) for hh in range(H))])
                    for mine in range(L)]
            within.append(ring_sum(bufs))
        for k in range(L):
            for hh in range(H):
                at = (k * H + hh) * n
                total = wire(within[0][at:at + n]).clone()
                for h in range(1, H):
                    total += wire(within[h][at:at + n])
                r = ranks[hh][k]
                out[r * s + b:r * s + b + n] = total
    return out


def _rs_ag(rank, world, hosts, interleaved):
    """reduce_scatter_tensor and all_gather_into_tensor on a hierarchical group (Note
    [Hierarchical reduce-scatter and all-gather] in csrc/shm/hier.h) against flat Gloo's,
    out of place and in place (as a sharded optimizer calls them), with the group's ranks
    on the hosts in blocks or interleaved (host = rank mod hosts); then again with a piece
    small enough that the pipelines run over many blocks, the last one short, the float32
    sums checked bit for bit against the hierarchy's order."""
    if interleaved:
        pycomm.shm.host_identity = lambda: f"host{rank % hosts}/boot"
    else:
        _pretend_hosts(rank, [world // hosts] * hosts)
    group = pycomm.shm.hierarchical_group(dist.group.WORLD)
    assert group is not None
    local = pycomm.shm.hierarchy(group)
    assert local["hosts"] == hosts and local["ranks_per_host"] == world // hosts
    places = [None] * world
    dist.all_gather_object(places, (local["host"], local["local_rank"]))
    ranks = [[r for r, _ in sorted(((r, p) for r, p in enumerate(places) if p[0] == h),
                                   key=lambda rp: rp[1][1])] for h in range(hosts)]

    def shm_ops():
        st = pycomm.shm.stats(group)
        return st["ops_on_caller_thread"] + st["ops_on_worker_thread"]

    def check(s, dtype, op):
        what = f"s={s} {dtype} {op} piece={backend.piece_bytes}"
        g = torch.Generator().manual_seed(s * 7 + rank)
        x = (torch.randn(world * s, generator=g) * 100).to(dtype)
        want = _flat_reference(x, op, world)[rank * s:(rank + 1) * s]
        exact = None
        if dtype == torch.float32 and op == dist.ReduceOp.SUM:
            every = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(every, x)
            piece = backend.piece_bytes // x.element_size()
            exact = _hierarchical_sum(every, ranks, s, piece)[rank * s:(rank + 1) * s]
        before = shm_ops()
        out = torch.empty(s, dtype=dtype)
        dist.reduce_scatter_tensor(out, x.clone(), op=op, group=group)
        assert s == 0 or shm_ops() > before, f"{what}: not reduced through shared memory"
        buf = x.clone()  # in place: the output is the rank's own range of the input
        dist.reduce_scatter_tensor(buf[rank * s:(rank + 1) * s], buf, op=op, group=group)
        for got in (out, buf[rank * s:(rank + 1) * s]):
            if dtype == torch.int64 or op == dist.ReduceOp.MAX:
                assert torch.equal(got, want), what
            elif exact is not None:
                assert torch.equal(got, exact), what
            else:  # by host, then across hosts: another order than Gloo's ring
                tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got.to(want.dtype), want, rtol=tol,
                                           atol=tol * 100, msg=what)
        y = x[:s].clone()
        flat = torch.empty(world * s, dtype=dtype)
        dist.all_gather_into_tensor(flat, y)
        gathered = torch.empty(world * s, dtype=dtype)
        dist.all_gather_into_tensor(gathered, y, group=group)
        assert torch.equal(gathered, flat), what
        gathered.zero_()[rank * s:(rank + 1) * s] = y  # in place
        dist.all_gather_into_tensor(gathered, gathered[rank * s:(rank + 1) * s], group=group)
        assert torch.equal(gathered, flat), what

    backend = group._get_backend(torch.device("cpu"))
    assert backend.piece_bytes == 2 << 20
    for s in (0, 1, 3, 1000, 70_001):
        for dtype, op in CASES:
            check(s, dtype, op)
    # 1 KiB pieces: 256 float32 per block, so 1000 takes 4 blocks and 4099 17, the last short
    backend.piece_bytes = 1024
    for s in (1000, 4099):
        for dtype, op in CASES:
            check(s, dtype, op)
    with pytest.raises(ValueError, match="piece_bytes must be positive, got 0"):
        backend.piece_bytes = 0
    with pytest.raises(ValueError, match="reduce_scatter_tensor: expected a Float tensor of "):
        dist.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world + 1), group=group)


@pytest.mark.parametrize("world, hosts, interleaved", [(4, 2, False), (4, 2, True), (6, 3, False),
                                                       (6, 2, True)],
                         ids=["2x2", "2x2-interleaved", "3x2", "2x3-interleaved"])
def test_reduce_scatter_and_all_gather_across_hosts(world, hosts, interleaved):
    run_ranks(_rs_ag, world_size=world, hosts=hosts, interleaved=interleaved)
