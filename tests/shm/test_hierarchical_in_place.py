"""DDP buckets reduced where their gradients are across hosts (Note [Hierarchical all-reduce
of pieces] in csrc/shm/hier_allreduce.cpp), on one machine whose ranks are told apart as
hosts by their host identity (as in test_hierarchical_on_one_host.py): every bucket goes in
place by default, on every wire, and param.grad gets the bits of the bucket's path, with
blocks whole and padded, and with ranks whose buckets take different paths."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.shm
from tests.ddp.test_in_place_reduction import ONE, TINY, _mixed_paths, _same_as_through_the_bucket
from tests.shm.test_hierarchical_on_one_host import _pretend_hosts
from tests.support.ddp_models import build
from tests.support.multirank import run_ranks

WIRES = {"fp32": {}, "bf16": {"wire": "bf16"},
         "int8+ef": {"wire": "int8", "wire_error_feedback": True}}


def _pair(base, **config):
    on = pycomm.DistributedDataParallel(copy.deepcopy(base),
                                        config=pycomm.DDPConfig(**config))
    off = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(in_place_reduction=False, **config))
    return on, off


def _set_piece(ddp, piece_bytes):
    """The hierarchy's piece (every rank the same): small, for several blocks a bucket."""
    backend = ddp.gradient_group._get_backend(torch.device("cpu"))
    assert isinstance(backend, pycomm._C.HierBackend)
    backend.piece_bytes = piece_bytes


def _odd():
    """The MLP with 3 outputs: a bucket of 3 elements (one parameter a bucket) and one of
    1,443 (one bucket): counts 2 ranks of a host do not divide, so blocks get padded."""
    model = build("mlp")
    torch.manual_seed(3)
    model.net[-1] = torch.nn.Linear(model.net[-1].in_features, 3)
    return model


def _same_bits(rank, world, per_host, wire):
    _pretend_hosts(rank, per_host)
    for model in ("mlp", "attn", "odd"):
        for cap in (TINY, None, ONE):
            config = dict(WIRES[wire], **({} if cap is None else {"bucket_cap_mb": cap}))
            on, off = _pair(_odd() if model == "odd" else build(model), **config)
            assert pycomm.shm.hierarchy(on.gradient_group)["hosts"] == len(per_host)
            # 64-byte pieces: a bucket of several blocks, its last one padded when the
            # bucket's elements do not divide by the ranks of a host
            _set_piece(on, 64)
            what = f"{model} cap={cap} wire={wire} hosts={per_host}"
            got = _same_as_through_the_bucket(on, off, model, rank, what)
            for g in got[-1]:  # every rank ends with the same bits
                gathered = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(gathered, g)
                assert all(torch.equal(g, x) for x in gathered), what
    # The flight record of the host's phases names the wire, in place as on the buffer;
    # with one rank per host there are none (Note [One rank per host] in
    # csrc/shm/hier_allreduce.cpp)
    ops = {e["op"] for e in pycomm.shm.flight_record(on.gradient_group)}
    tag = "" if wire == "fp32" else f"[wire={wire}]"
    phases = {f"reduce_scatter_tensor{tag}", f"all_gather_into_tensor{tag}"}
    if max(per_host) == 1:
        assert not phases & ops, ops
    else:
        assert phases <= ops, ops


@pytest.mark.parametrize("per_host,wire", [([2, 2], "fp32"), ([2, 2], "bf16"),
                                           ([2, 2], "int8+ef"), ([1, 1, 1], "bf16")],
                         ids=["2x2-fp32", "2x2-bf16", "2x2-int8+ef", "3x1-bf16"])
def test_same_bits_as_through_the_bucket(per_host, wire):
    run_ranks(_same_bits, world_size=sum(per_host), per_host=per_host, wire=wire)


def _mixed_paths_across_hosts(rank, world, wire):
    """test_in_place_reduction.py's ranks on different paths, at 2 hosts x 2 ranks."""
    _pretend_hosts(rank, [2, 2])
    _mixed_paths(rank, world, config=WIRES[wire], prepare=lambda ddp: _set_piece(ddp, 64))


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_ranks_on_different_paths_add_the_same_elements(wire):
    run_ranks(_mixed_paths_across_hosts, world_size=4, wire=wire)


class _AsDouble(torch.nn.Module):
    """`inner` in float64, fed the float32 inputs the tests make."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner.double()

    def forward(self, x):
        return self.inner(x.double())


def _float64(rank, world):
    """float64 gradients go in place on the float32 wire (the pieces and the Gloo leg take
    them), with the buffer's bits."""
    _pretend_hosts(rank, [2, 2])
    for cap in (TINY, ONE):
        on, off = _pair(_AsDouble(_odd()), bucket_cap_mb=cap)
        _set_piece(on, 64)
        _same_as_through_the_bucket(on, off, "odd", rank, f"float64 cap={cap}")
        assert all(p.grad.dtype == torch.float64 for p in on.parameters())


def test_float64_goes_in_place_on_the_float32_wire():
    run_ranks(_float64, world_size=4)


def _what_stays_on_the_buffer(rank, world):
    """A bfloat16 model's buckets go through their buffers on a low-precision wire (it
    encodes from float32) and on the float32 one (the pieces are float32 or float64);
    in_place_reduction=False keeps every bucket there."""
    _pretend_hosts(rank, [2, 2])
    for config in ({"wire": "bf16"}, {}):
        base = build("mlp").to(torch.bfloat16)
        ddp = pycomm.DistributedDataParallel(copy.deepcopy(base),
                                             config=pycomm.DDPConfig(**config))
        x = torch.randn(8, 8, dtype=torch.bfloat16,
                        generator=torch.Generator().manual_seed(rank))
        ddp(x).float().pow(2).mean().backward()
        ways = [b["in_place"] for b in ddp.timelines(1)[0]["buckets"]]
        assert not any(ways), (config, ways)
        for p in ddp.parameters():
            gathered = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(gathered, p.grad)
            assert all(torch.equal(p.grad, g) for g in gathered), config


def test_what_stays_on_the_buffer():
    run_ranks(_what_stays_on_the_buffer, world_size=4)
