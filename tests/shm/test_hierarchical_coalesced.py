"""The coalesced into-tensor collectives on the hierarchical "pycomm" group (what torch's
coalescing manager issues, and FSDP2 through it), and the group's own wire option
(pycomm.shm.Options(wire=...)) that makes its reduce-scatters cross hosts in bf16 or int8
with float32 sums, FSDP2's included. Hosts are told apart by their identity on one machine
(as in test_hierarchical_on_one_host.py).

A coalesced list runs as one collective over the entries packed rank by rank (Note
[Coalesced into-tensor collectives] in csrc/shm/coalesced.h): its results
are, bit for bit, the single collective's on that packed buffer, whose order the
hierarchy's note gives; the all-gather is Gloo's exactly."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.shm
from tests.shm.test_hierarchical_on_one_host import _hierarchical_sum, _pretend_hosts
from tests.shm.test_wire import _bf16, _gathered
from tests.shm.test_wire_sharded import _layout
from tests.support.multirank import run_ranks

# entries of one coalesced call: elements per rank's range (0 included, and one larger
# than a 2 MiB piece so the pipeline runs over several blocks)
RANGES = [3, 0, 1000, 1, 600_001]


def _entries(rank, world, dtype, seed, ranges=RANGES):
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return [(torch.randn(world * s, generator=g) * 100).to(dtype) for s in ranges]


def _packed(inputs, world):
    """The entries' inputs packed rank by rank: rank r's block holds every entry's range r
    back to back (the layout the coalesced reduce-scatter runs one collective on)."""
    return torch.cat([x.view(world, -1)[r] for r in range(world) for x in inputs])


def _coalesced_reduce_scatter(outputs, inputs, group, op=dist.ReduceOp.SUM):
    with dist._coalescing_manager(group=group):
        for out, x in zip(outputs, inputs):
            dist.reduce_scatter_tensor(out, x, op=op, group=group)


def _coalesced_all_gather(outputs, inputs, group):
    with dist._coalescing_manager(group=group):
        for out, x in zip(outputs, inputs):
            dist.all_gather_into_tensor(out, x, group=group)


def _split(block, ranges):
    return list(block.split(list(ranges)))


def _coalesced(rank, world, per_host):
    _pretend_hosts(rank, per_host)
    group = pycomm.shm.hierarchical_group(dist.group.WORLD, one_rank_per_host=True)
    backend = group._get_backend(torch.device("cpu"))
    st = pycomm.shm.stats(group)
    before = st["ops_on_caller_thread"] + st["ops_on_worker_thread"]

    for seed, (dtype, op) in enumerate([(torch.float32, dist.ReduceOp.SUM),
                                        (torch.float32, dist.ReduceOp.AVG),
                                        (torch.bfloat16, dist.ReduceOp.SUM),
                                        (torch.int64, dist.ReduceOp.SUM),
                                        (torch.float32, dist.ReduceOp.MAX)]):
        what = f"{dtype} {op}"
        inputs = _entries(rank, world, dtype, seed)
        outputs = [torch.full((s,), -1, dtype=dtype) for s in RANGES]
        _coalesced_reduce_scatter(outputs, [x.clone() for x in inputs], group, op)
        # the one collective it is: the packed buffer's single reduce-scatter
        mine = torch.empty(sum(RANGES), dtype=dtype)
        dist.reduce_scatter_tensor(mine, _packed(inputs, world), op=op, group=group)
        for i, (got, want) in enumerate(zip(outputs, _split(mine, RANGES))):
            assert torch.equal(got, want), (what, i)
        if dtype == torch.float32 and op == dist.ReduceOp.SUM:  # its order, bit for bit
            every = _gathered(_packed(inputs, world), world)
            block = sum(RANGES)
            exact = _hierarchical_sum(every, _layout(group, world), block,
                                      backend.piece_bytes // 4)
            assert torch.equal(mine, exact[rank * block:(rank + 1) * block]), what
        # against Gloo's, entry by entry: exact for integers and MAX, rounding otherwise
        for i, (x, got) in enumerate(zip(inputs, outputs)):
            flat = x.clone().double() if dtype == torch.bfloat16 else x.clone()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op)
            want = flat.view(world, -1)[rank]
            want = want / world if op == dist.ReduceOp.AVG else want
            if dtype == torch.int64 or op == dist.ReduceOp.MAX:
                assert torch.equal(got, want), (what, i)
            else:
                tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got.to(want.dtype), want, rtol=tol, atol=tol * 100)

    # all-gather, entries of mixed dtypes: bytes, Gloo's bit for bit
    inputs = [torch.randn(s, generator=torch.Generator().manual_seed(rank + s)) for s in RANGES]
    inputs[2] = inputs[2].to(torch.bfloat16)
    inputs[3] = torch.arange(rank, rank + RANGES[3], dtype=torch.int64)
    outputs = [torch.empty(world * x.numel(), dtype=x.dtype) for x in inputs]
    _coalesced_all_gather(outputs, inputs, group)
    for i, (x, got) in enumerate(zip(inputs, outputs)):
        want = torch.empty_like(got)
        dist.all_gather_into_tensor(want, x)  # flat Gloo
        assert torch.equal(got, want), i
    st = pycomm.shm.stats(group)
    if per_host[0] > 1:  # one rank per host has no shared-memory phase
        assert st["ops_on_caller_thread"] + st["ops_on_worker_thread"] > before

    # bad lists, named by entry, and the group still usable after
    with pytest.raises(ValueError, match="reduce_scatter_tensor_coalesced: entry 1 is "
                                         "BFloat16, entry 0 is Float"):
        _coalesced_reduce_scatter([torch.empty(2), torch.empty(2, dtype=torch.bfloat16)],
                                  [torch.empty(2 * world),
                                   torch.empty(2 * world, dtype=torch.bfloat16)], group)
    with pytest.raises(ValueError, match="all_gather_into_tensor_coalesced: entry 1 has a "
                                         "Float input of 3 elements and a Float output of 7"):
        _coalesced_all_gather([torch.empty(world * 2), torch.empty(7)],
                              [torch.empty(2), torch.empty(3)], group)
    x = torch.ones(4 * world)
    out = torch.empty(4)
    _coalesced_reduce_scatter([out], [x], group)
    assert torch.equal(out, torch.full((4,), float(world)))


@pytest.mark.parametrize("per_host", [[2, 2], [1, 1]], ids=["2x2", "2x1"])
def test_coalesced_collectives_across_hosts(per_host):
    run_ranks(_coalesced, world_size=sum(per_host), per_host=per_host)


def _wire_group(rank, world, per_host, wire):
    _pretend_hosts(rank, per_host)
    return dist.new_group(backend="pycomm", pg_options=pycomm.shm.Options(wire=wire))


def _group_wire(rank, world, per_host):
    """A group made with Options(wire="bf16"): its reduce-scatters (single, coalesced,
    SUM and AVG, float32 and bfloat16) cross in bf16 with float32 sums, bit for bit the
    hierarchy's order with each host's sum rounded once; its all-reduces, all-gathers and
    float64 reduce-scatters cross as they are (the same bits as an fp32 group's)."""
    group = _wire_group(rank, world, per_host, "bf16")
    plain = _wire_group(rank, world, per_host, "fp32")
    backend = group._get_backend(torch.device("cpu"))
    assert backend.wire == "bf16" and plain._get_backend(torch.device("cpu")).wire == "fp32"
    ranks = _layout(group, world)
    s = 70_001
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * s, generator=g) * 100
    every = _gathered(x, world)
    piece = backend.piece_bytes // 4
    want = _hierarchical_sum(every, ranks, s, piece, wire=_bf16)[rank * s:(rank + 1) * s]
    exact = _hierarchical_sum(every, ranks, s, piece)[rank * s:(rank + 1) * s]
    assert not torch.equal(want, exact)  # the wire shows in the bits

    out = torch.empty(s)
    dist.reduce_scatter_tensor(out, x.clone(), group=group)
    assert torch.equal(out, want)
    dist.reduce_scatter_tensor(out, x.clone(), op=dist.ReduceOp.AVG, group=group)
    assert torch.equal(out, want / world)
    buf = x.clone()  # in place
    dist.reduce_scatter_tensor(buf[rank * s:(rank + 1) * s], buf, group=group)
    assert torch.equal(buf[rank * s:(rank + 1) * s], want)
    low = torch.empty(s, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(low, x.to(torch.bfloat16), group=group)
    every_low = [t.to(torch.bfloat16).float() for t in every]
    assert torch.equal(low, _hierarchical_sum(every_low, ranks, s, piece, wire=_bf16)[
        rank * s:(rank + 1) * s].to(torch.bfloat16))
    if per_host[0] > 1:  # the host's phase is labelled with the wire
        ops = {r["op"] for r in pycomm.shm.flight_record(group)}
        assert "reduce_scatter_tensor[wire=bf16]" in ops, ops

    # coalesced: the packed buffer's reduce-scatter on the wire
    inputs = _entries(rank, world, torch.float32, 7)
    outputs = [torch.empty(n) for n in RANGES]
    _coalesced_reduce_scatter(outputs, inputs, group)
    mine = torch.empty(sum(RANGES))
    dist.reduce_scatter_tensor(mine, _packed(inputs, world), group=group)
    assert all(torch.equal(a, b) for a, b in zip(outputs, _split(mine, RANGES)))

    # what the wire does not carry: the fp32 group's bits
    for op in ("all_reduce", "float64", "max", "all_gather"):
        a, b = x.clone(), x.clone()
        if op == "all_reduce":
            dist.all_reduce(a, group=group)
            dist.all_reduce(b, group=plain)
        elif op == "float64":
            a, b = torch.empty(s, dtype=torch.float64), torch.empty(s, dtype=torch.float64)
            dist.reduce_scatter_tensor(a, x.double(), group=group)
            dist.reduce_scatter_tensor(b, x.double(), group=plain)
        elif op == "max":
            a, b = torch.empty(s), torch.empty(s)
            dist.reduce_scatter_tensor(a, x.clone(), op=dist.ReduceOp.MAX, group=group)
            dist.reduce_scatter_tensor(b, x.clone(), op=dist.ReduceOp.MAX, group=plain)
        else:
            a, b = torch.empty(world * world * s), torch.empty(world * world * s)
            dist.all_gather_into_tensor(a, x, group=group)
            dist.all_gather_into_tensor(b, x, group=plain)
        assert torch.equal(a, b), op


@pytest.mark.parametrize("per_host", [[2, 2], [1, 1, 1]], ids=["2x2", "3x1"])
def test_a_groups_wire_carries_its_reduce_scatters(per_host):
    run_ranks(_group_wire, world_size=sum(per_host), per_host=per_host)


def _bad_options(rank, world):
    with pytest.raises(TypeError, match=r'a "pycomm" group takes '
                                        r"pg_options=pycomm.shm.Options\(...\), got builtins.dict"):
        dist.new_group(backend="pycomm", pg_options={"wire": "bf16"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = dist.new_group(backend="pycomm", pg_options=pycomm.shm.Options(wire="int8"))
    assert any("nothing crosses a host, so Options(wire='int8') changes nothing"
               in str(w.message) for w in caught), [str(w.message) for w in caught]
    x = torch.arange(4.0 * world)
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, x, group=group)
    assert torch.equal(out, torch.arange(4.0 * rank, 4.0 * rank + 4) * world)


def test_bad_group_options_are_named():
    with pytest.raises(ValueError, match="wire must be 'fp32', 'bf16' or 'int8'"):
        pycomm.shm.Options(wire="fp16")
    with pytest.raises(ValueError, match="keep no error-feedback residual"):
        pycomm.shm.Options(wire=pycomm.Wire("int8", error_feedback=True))
    with pytest.raises(TypeError, match="takes a pycomm.Wire or one of"):
        pycomm.shm.Options(wire=torch.bfloat16)
    assert pycomm.shm.Options(wire="bf16").wire == pycomm.Wire("bf16")
    run_ranks(_bad_options, world_size=2)
