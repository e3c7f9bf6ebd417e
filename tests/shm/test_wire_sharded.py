"""The low-precision wire under sharding: the hierarchy's reduce-scatter whose cross-host
all-to-all carries the wire (HierBackend.reduce_scatter_wire; Note [Low-precision wire] in
csrc/shm/wire_codec.h), and pycomm.ZeroRedundancyOptimizer(release_gradients=True) on a
DDP with DDPConfig(wire=...), whose buckets it reduce-scatters. Hosts are told apart by
their identity on one machine (as in test_hierarchical_on_one_host.py). Each host's sum of
a range crosses once in the wire and the hosts' sums are added in float32: bit for bit the
order the note gives, on inputs where a bf16 sum would round; int8 within its bound, and
error feedback cancelling it over calls."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

import pycomm
import pycomm.shm
from tests.shm.test_hierarchical_on_one_host import _hierarchical_sum, _pretend_hosts
from tests.shm.test_wire import _bf16, _gathered, _wire_backend
from tests.support.ddp_models import build
from tests.support.multirank import run_ranks


def _layout(group, world):
    """ranks[h][l]: the group rank of host h's local rank l."""
    local = pycomm.shm.hierarchy(group)
    places = [None] * world
    dist.all_gather_object(places, (local["host"], local["local_rank"]))
    return [[r for r, _ in sorted(((r, p) for r, p in enumerate(places) if p[0] == h),
                                  key=lambda rp: rp[1][1])] for h in range(local["hosts"])]


def _crafted(rank, world):
    """Three hosts: every rank's range sums 1 + 2^-8 + 2^-8, bfloat16 terms whose bfloat16
    sum rounds back to 1; the float32 sum 1 + 2^-7 is itself a bfloat16."""
    _, backend = _wire_backend(rank, [1, 1, 1])
    out = torch.empty(5)
    backend.reduce_scatter_wire(out, torch.full((5 * world,), [1.0, 2.0 ** -8, 2.0 ** -8][rank]),
                                "bf16")
    assert torch.equal(out, torch.full((5,), 1 + 2.0 ** -7)), out


def _reduce_scatter(rank, world):
    """2 hosts x 2 ranks: bf16 bit for bit against the hierarchy's float32 order with each
    host's sum rounded once to bf16 (out of place, in place, asynchronous, bf16 tensors,
    one block and many, the last short); int8 within its bound, and with error feedback
    the mean of repeated calls converging on the exact sum; bad arguments named."""
    group, backend = _wire_backend(rank, [2, 2])
    ranks = _layout(group, world)
    H = len(ranks)

    def check(s):
        what = f"s={s} piece={backend.piece_bytes}"
        g = torch.Generator().manual_seed(s * 7 + rank)
        x = torch.randn(world * s, generator=g) * 100
        every = _gathered(x, world)
        piece = backend.piece_bytes // 4
        mine = slice(rank * s, (rank + 1) * s)
        exact = _hierarchical_sum(every, ranks, s, piece)[mine]
        want = _hierarchical_sum(every, ranks, s, piece, wire=_bf16)[mine]
        if s >= 1000:
            assert not torch.equal(want, exact), "the test must see the wire's rounding"
        out = torch.empty(s)
        backend.reduce_scatter_wire(out, x.clone(), "bf16")
        assert torch.equal(out, want), what
        buf = x.clone()  # in place: the output is the rank's own range of the input
        backend.reduce_scatter_wire(buf[mine], buf, "bf16", async_op=True).wait()
        assert torch.equal(buf[mine], want), what
        low = torch.empty(s, dtype=torch.bfloat16)
        backend.reduce_scatter_wire(low, x.to(torch.bfloat16), "bf16")
        every_low = [e.to(torch.bfloat16).float() for e in every]
        want_low = _hierarchical_sum(every_low, ranks, s, piece, wire=_bf16)[mine]
        assert torch.equal(low, want_low.to(torch.bfloat16)), what
        # int8: each host's sum of a block within half its scale (max |x| / 127)
        out8 = torch.empty(s)
        backend.reduce_scatter_wire(out8, x.clone(), "int8")
        peak = [0.0] * H
        calls = [0]  # _hierarchical_sum applies the wire to hosts 0, ..., H-1 in turn

        def record(t):
            h = calls[0] % H
            calls[0] += 1
            peak[h] = max(peak[h], t.abs().max().item())
            return t

        _hierarchical_sum(every, ranks, s, piece, wire=record)
        err = (out8 - exact).abs().max().item()
        assert err <= sum(peak) / 254 * 1.001 + 1e-3, (what, err, peak)
        assert s < 1000 or err > 0, "the test must see int8's rounding"
        return x, exact, err

    for s in (1, 3, 1000, 70_001):
        check(s)
    backend.piece_bytes = 1024  # 256 float32 per block: 4099 takes 17, the last short
    x, exact, single = check(4099)
    # error feedback: what each call loses is added to the next, so the mean of n calls on
    # the same input is within about one call's error / n of the exact sum
    residual = pycomm._C.WireResidual()
    total = torch.zeros_like(exact)
    for _ in range(16):
        out = torch.empty_like(exact)
        backend.reduce_scatter_wire(out, x.clone(), "int8", error_feedback=True,
                                    residual=residual)
        total += out
    assert residual.sent.numel() == 4099 * H and residual.summed is None
    mean_err = (total / 16 - exact).abs().max().item()
    assert mean_err < single / 4, (mean_err, single)
    ops = {e["op"] for e in pycomm.shm.flight_record(group)}
    assert {"reduce_scatter_tensor[wire=bf16]", "reduce_scatter_tensor[wire=int8]",
            "reduce_scatter_tensor[wire=int8+ef]"} <= ops
    with pytest.raises(ValueError, match=r"reduce_scatter_tensor\[wire=int8\+ef\]: error "
                                         r"feedback needs a residual"):
        backend.reduce_scatter_wire(torch.empty(3), torch.empty(3 * world), "int8",
                                    error_feedback=True)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 tensors, got Double"):
        backend.reduce_scatter_wire(torch.empty(3, dtype=torch.float64),
                                    torch.empty(3 * world, dtype=torch.float64), "bf16")
    with pytest.raises(ValueError, match="wire must be 'fp32', 'bf16' or 'int8'"):
        backend.reduce_scatter_wire(torch.empty(3), torch.empty(3 * world), "fp8")
    with pytest.raises(ValueError, match=r"reduce_scatter_tensor\[wire=bf16\]: expected"):
        backend.reduce_scatter_wire(torch.empty(3), torch.empty(3 * world + 1), "bf16")
    out = torch.empty(4)  # the group still works after the refusals
    backend.reduce_scatter_wire(out, torch.ones(4 * world), "bf16")
    assert torch.equal(out, torch.full((4,), float(world)))


def test_reduce_scatter_sums_float32_across_three_hosts():
    run_ranks(_crafted, world_size=3)


def test_reduce_scatter_carries_the_wire():
    run_ranks(_reduce_scatter, world_size=4)


def _loss(model, x):
    return model(x).pow(2).mean()


def _zero_wire(rank, world, wire, feedback, tol, compile_too):
    """ZeroRedundancyOptimizer(release_gradients=True) on a DDP with the wire, against the
    same on a float32 DDP, through the first step (whole buckets all-reduced in the wire:
    the all-reduce's shared-memory phases, its all-gather among them, carry the wire's name),
    no_sync accumulation, the DDP's clip from the shards, join with uneven inputs and
    torch.compile: after the first step every bucket crosses hosts in the wire's
    reduce-scatter, the ranks' parameters stay bit for bit equal, and close to float32's."""
    _pretend_hosts(rank, [2, 2])
    torch.manual_seed(0)
    base = build("mlp")
    x = [torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * i + rank))
         for i in range(6)]
    models, kept = {}, {}
    for name, w, fb in (("low", wire, feedback), ("fp32", "fp32", False)):
        ddp = pycomm.DistributedDataParallel(
            copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=0.002, wire=w,
                                                         wire_error_feedback=fb))
        zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1,
                                              release_gradients=True)
        assert zero._hook_state.keep.wire == (None if w == "fp32" else pycomm.Wire(w, fb))
        seen = 0
        for i in range(3):
            if i == 1:  # from here the buckets are final: reduce-scattered
                record = pycomm.shm.flight_record(ddp.gradient_group)
                seen = max(e["seq"] for e in record)
                if w != "fp32":  # the first step all-reduced whole buckets in the wire
                    label = w + ("+ef" if fb else "")
                    assert {e["op"] for e in record if "[wire=" in e["op"]} == {
                        f"reduce_scatter_tensor[wire={label}]",
                        f"all_gather_into_tensor[wire={label}]"}
            zero.zero_grad()
            with ddp.no_sync():  # accumulated locally: nothing crosses
                _loss(ddp, x[0]).backward()
            _loss(ddp, x[1 + i]).backward()
            assert all(p.grad is None for p in ddp.parameters()), "released"
            if i == 2:  # the shards of a final step's averaged gradients
                kept[name] = {k: v.clone() for k, v in zero._hook_state.grads.items()}
            norm = ddp.clip_grad_norm_(0.05)
            assert norm > 0.05, "the test must clip"
            zero.step()
        with Join([ddp, zero]):  # rank 3 runs out of batches first
            for step in range(2 + (rank < 3)):
                zero.zero_grad()
                _loss(ddp, x[3 + step]).backward()
                zero.step()
        zero.wait_for_params()
        models[name] = (ddp, zero)
        if w != "fp32":
            label = w + ("+ef" if fb else "")
            later = {e["op"] for e in pycomm.shm.flight_record(ddp.gradient_group)
                     if e["seq"] > seen and "[wire=" in e["op"]}
            assert later == {f"reduce_scatter_tensor[wire={label}]"}, later
    assert kept["low"].keys() == kept["fp32"].keys()
    for index, got in kept["low"].items():
        want = kept["fp32"][index]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < (0.01 if wire == "bf16" else 0.1), (index, rel)
    for (name, a), b in zip(models["low"][0].module.named_parameters(),
                            models["fp32"][0].module.parameters()):
        assert all(torch.equal(t, a) for t in _gathered(a.detach(), world)), name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol / 10, msg=name)
    if compile_too:
        ddp, zero = models["low"]
        compiled = torch.compile(ddp, backend="aot_eager")
        zero.zero_grad()
        _loss(compiled, x[0]).backward()
        zero.step()
        zero.wait_for_params()
        for p in ddp.module.parameters():
            assert all(torch.equal(t, p) for t in _gathered(p.detach(), world))


@pytest.mark.parametrize("wire,feedback,tol,compile_too",
                         [("bf16", False, 1e-2, True), ("int8", True, 5e-2, False)],
                         ids=["bf16", "int8+ef"])
def test_released_sharded_optimizer_carries_the_wire(wire, feedback, tol, compile_too):
    run_ranks(_zero_wire, world_size=4, wire=wire, feedback=feedback, tol=tol,
              compile_too=compile_too)

