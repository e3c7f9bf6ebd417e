"""The low-precision wire of the hierarchical all-reduce (DDPConfig.wire; Note
[Low-precision wire] in csrc/shm/wire_codec.h), on one machine whose ranks are told apart
as hosts by their host identity (as in test_hierarchical_on_one_host.py): the sums are
float32 (bit for bit the order the note gives, on inputs where summing in bf16 would
round), every rank ends with the same bits, int8's error stays within its bound and error
feedback cancels it over steps; and DDP's option, its refusals and its report."""

from __future__ import annotations

import copy
import pickle
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.shm
from tests.shm.test_hierarchical_on_one_host import _pretend_hosts
from tests.support.ddp_models import build
from tests.support.multirank import exit_rank, run_ranks


def _wire_backend(rank, per_host, piece_bytes=None):
    _pretend_hosts(rank, per_host)
    group = pycomm.shm.hierarchical_group(dist.group.WORLD, one_rank_per_host=True)
    backend = group._get_backend(torch.device("cpu"))
    assert pycomm.shm.hierarchy(group)["hosts"] == len(per_host)
    if piece_bytes is not None:
        backend.piece_bytes = piece_bytes
    return group, backend


def _gathered(x, world):
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x)
    return out


def _bf16(x):
    return x.to(torch.bfloat16).float()


def _crafted_bf16(rank, world):
    """Three hosts: 1 + 2^-8 + 2^-8. Each term is a bfloat16; summed in bfloat16 the first
    addition rounds back to 1 and so does the second, where the float32 sum 1 + 2^-7 is
    itself a bfloat16: the wire must give it."""
    _, backend = _wire_backend(rank, [1, 1, 1])
    x = torch.full((7,), [1.0, 2.0 ** -8, 2.0 ** -8][rank])
    backend.allreduce_wire(x, "bf16")
    assert torch.equal(x, torch.full((7,), 1 + 2.0 ** -7)), x
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    assert ((one + 2.0 ** -8) + 2.0 ** -8).item() == 1.0  # what summing in bf16 gives


def test_bf16_partial_sums_are_float32():
    run_ranks(_crafted_bf16, world_size=3)


def _bf16_reference(xs, per_host):
    """What the bf16 wire computes: each host's ranks summed in float32 in rank order,
    rounded to bf16 on the way out, the hosts' values summed in float32 in host order,
    the sum rounded to bf16 on the way back."""
    total, first = None, 0
    for n in per_host:
        part = xs[first].clone()
        for r in range(first + 1, first + n):
            part += xs[r]
        first += n
        total = _bf16(part) if total is None else total + _bf16(part)
    return _bf16(total)


def _bf16_order(rank, world, per_host, piece_bytes):
    _, backend = _wire_backend(rank, per_host, piece_bytes)
    # with small pieces 1,024 elements already make a hundred blocks (100,003 made ten
    # thousand, a Gloo round trip each: 28 s at 3 x 1 for nothing more)
    sizes = (0, 1, 3, 7, 1024, 100_003) if piece_bytes is None else (0, 1, 3, 7, 1024, 2_051)
    for n in sizes:
        g = torch.Generator().manual_seed(n * 7 + rank)
        x = torch.randn(n, generator=g) * 10
        xs = _gathered(x, world)
        backend.allreduce_wire(x, "bf16")
        assert torch.equal(x, _bf16_reference(xs, per_host)), n
        assert all(torch.equal(t, x) for t in _gathered(x, world)), n


@pytest.mark.parametrize("per_host,piece_bytes", [([2, 2], None), ([1, 1, 1], None),
                                                  ([2, 2], 100), ([1, 1, 1], 36)],
                         ids=["2x2", "3x1", "2x2-blocks", "3x1-blocks"])
def test_bf16_wire_sums_in_float32_in_the_noted_order(per_host, piece_bytes):
    """Bit for bit against the reference, every rank the same bits; small pieces make the
    pipeline run many blocks, the last short and its chunks padded."""
    run_ranks(_bf16_order, world_size=sum(per_host), per_host=per_host,
              piece_bytes=piece_bytes)


def _int8(x):
    """One int8 encoding and its decoding, in float32 as the codec computes it: per block of
    256 elements, scale = max|x| / 127, x / scale rounded to nearest even (x x (127 / max)),
    decoded as q x scale."""
    out = torch.empty_like(x)
    for begin in range(0, x.numel(), 256):
        v = x[begin:begin + 256]
        m = v.abs().max()
        inv = torch.tensor(127.0) / m
        q = torch.clamp(torch.round(v * inv), -127, 127)
        out[begin:begin + 256] = q * (m / torch.tensor(127.0))
    return out


def _int8_exact(rank, world):
    """One rank per host: each host's piece is the whole tensor (one block), cut into
    `world` chunks; chunk h's encodings summed in float32 in host order by its owner,
    the sum encoded once and decoded by all."""
    _, backend = _wire_backend(rank, [1] * world)
    for n in (1, 5, 256, 700, 4099):
        g = torch.Generator().manual_seed(n + 13 * rank)
        x = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)
        xs = _gathered(x, world)
        q = -(-n // world)
        want = torch.empty(n)
        for h in range(world):
            c = slice(h * q, min(n, (h + 1) * q))
            acc = _int8(xs[0][c])
            for r in range(1, world):
                acc = acc + _int8(xs[r][c])
            want[c] = _int8(acc)
        backend.allreduce_wire(x, "int8")
        assert torch.equal(x, want), (n, (x - want).abs().max())


@pytest.mark.parametrize("hosts", [2, 3])
def test_int8_wire_is_the_noted_encoding_bit_for_bit(hosts):
    run_ranks(_int8_exact, world_size=hosts)


def _int8_bound(rank, world, per_host, piece_bytes):
    _, backend = _wire_backend(rank, per_host, piece_bytes)
    hosts = len(per_host)
    for n in (1, 5, 256, 257, 4099, 100_000):
        g = torch.Generator().manual_seed(n + 31 * rank)
        x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)  # magnitudes vary
        exact = torch.stack(_gathered(x.double(), world)).sum(0)
        backend.allreduce_wire(x, "int8")
        assert all(torch.equal(t, x) for t in _gathered(x, world)), n
        # Each host's sum loses at most half a step of its block's scale going out, the
        # total as much coming back: a step is the block's largest magnitude / 127.
        largest = exact.abs().max().item() + sum(
            t.abs().max().item() for t in _gathered(x, world))
        err = (x.double() - exact).abs().max().item()
        assert err <= (hosts + 1) * largest / 254 * 1.001, (n, err, largest)
        rel = ((x.double() - exact).norm() / exact.norm()).item()
        assert rel < 0.02, (n, rel)


@pytest.mark.parametrize("per_host,piece_bytes", [([2, 2], None), ([1, 1, 1], 1000)],
                         ids=["2x2", "3x1-blocks"])
def test_int8_wire_error_within_its_bound(per_host, piece_bytes):
    run_ranks(_int8_bound, world_size=sum(per_host), per_host=per_host,
              piece_bytes=piece_bytes)


def _feedback(rank, world):
    """The same gradient 40 times: without error feedback int8 makes the same error at
    every step, so the running sum drifts from the exact one linearly; with it the
    residual carries each step's loss into the next and the drift stays under a step."""
    _, backend = _wire_backend(rank, [2, 2], piece_bytes=2048)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3000, generator=g) * torch.logspace(-2, 0, 3000)
    exact = torch.stack(_gathered(x.double(), world)).sum(0)
    step = exact.abs().max().item() / 127
    residual = pycomm._C.WireResidual()
    drift = {}
    for feedback in (False, True):
        total = torch.zeros(3000, dtype=torch.float64)
        for _ in range(40):
            y = x.clone()
            backend.allreduce_wire(y, "int8", error_feedback=feedback,
                                   residual=residual if feedback else None)
            total += y.double()
        drift[feedback] = (total - 40 * exact).abs().max().item()
    assert residual.sent.numel() > 0 and residual.summed.numel() > 0
    assert drift[True] <= 2 * step, (drift, step)
    assert drift[False] >= 5 * drift[True], drift


def test_int8_error_feedback_cancels_the_error_over_steps():
    run_ranks(_feedback, world_size=4)


def _nonfinite(rank, world):
    _, backend = _wire_backend(rank, [1, 1])
    x = torch.ones(600)
    if rank == 1:
        x[300] = float("inf")
    y = x.clone()
    backend.allreduce_wire(y, "bf16")
    assert y[300].item() == float("inf") and torch.equal(y[:256], torch.full((256,), 2.0))
    y = x.clone()
    residual = pycomm._C.WireResidual()
    backend.allreduce_wire(y, "int8", error_feedback=True, residual=residual)
    assert not torch.isfinite(y[300]) and torch.isfinite(y[:256]).all()
    assert torch.isfinite(residual.sent).all()  # the bad block left its residual alone


def test_a_nonfinite_gradient_stays_nonfinite():
    run_ranks(_nonfinite, world_size=2)


def _one_rank_per_host(rank, world, per_host):
    """Note [One rank per host] in csrc/shm/hier_allreduce.cpp: with one rank per host the
    hierarchy's all-reduce (plain and on the wire), reduce-scatter and all-gather run no
    shared-memory phase (the local flight record gets none of them);
    with two ranks a host they do. Two hosts' sums have one order: bitwise a + b, and on
    the bf16 wire each host's value crosses once in bf16, summed in float32, the sum
    crossing once more (Note [Low-precision wire] in csrc/shm/wire_codec.h)."""
    group, backend = _wire_backend(rank, per_host, piece_bytes=1024)
    hosts = len(per_host)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    everyone = _gathered(x, world)
    seen = max([e["seq"] for e in pycomm.shm.flight_record(group)], default=0)
    fp32, bf16 = x.clone(), x.clone()
    dist.all_reduce(fp32, group=group)
    backend.allreduce_wire(bf16, "bf16")
    out = torch.empty(3000 // world)
    dist.reduce_scatter_tensor(out, x.clone(), group=group)
    gathered = torch.empty(out.numel() * world)
    dist.all_gather_into_tensor(gathered, out, group=group)
    local = [e["op"] for e in pycomm.shm.flight_record(group) if e["seq"] > seen]
    if max(per_host) == 1:
        assert local == [], local
    else:
        assert len(local) >= 8, local
    if hosts == 2 and world == 2:
        a, b = everyone
        assert torch.equal(fp32, a + b)
        assert torch.equal(bf16, _bf16(_bf16(a) + _bf16(b)))
    want = torch.stack(everyone).sum(0)
    torch.testing.assert_close(fp32, want, rtol=1e-6, atol=1e-5)
    mine = slice(rank * out.numel(), (rank + 1) * out.numel())
    torch.testing.assert_close(out, want[mine], rtol=1e-6, atol=1e-5)
    assert torch.equal(gathered, torch.cat(_gathered(out, world)))


@pytest.mark.parametrize("per_host", [[1, 1], [2, 2]], ids=["2x1", "2x2"])
def test_one_rank_per_host_runs_no_shared_memory_phase(per_host):
    run_ranks(_one_rank_per_host, world_size=sum(per_host), per_host=per_host)


def _tiny(rank, world):
    """Blocks whose largest magnitude is below what any float32 scale decodes (127 /
    FLT_MAX, subnormals included) go as zeros: no nan, no spurious values; with error
    feedback the residual keeps them whole."""
    _, backend = _wire_backend(rank, [1, 1])
    x = torch.zeros(512)
    x[:256] = 1e-38 * (rank + 1)  # a block of tiny values; the next block zeros
    y = x.clone()
    backend.allreduce_wire(y, "int8")
    assert torch.equal(y, torch.zeros(512)), y[:4]
    residual = pycomm._C.WireResidual()
    y = x.clone()
    backend.allreduce_wire(y, "int8", error_feedback=True, residual=residual)
    assert torch.equal(y, torch.zeros(512))
    assert residual.sent.abs().sum().item() > 0 and torch.isfinite(residual.sent).all()


def test_int8_blocks_too_small_to_scale_go_as_zeros():
    run_ranks(_tiny, world_size=2)


def _layout(rank, world):
    """A residual made for one layout restarts when the piece changes it, even where its
    size stays (4,096 elements at 2 x 2: 2 blocks of 1,024 per rank, then 1 of 2,048)."""
    _, backend = _wire_backend(rank, [2, 2], piece_bytes=4096)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    kept = pycomm._C.WireResidual()
    backend.allreduce_wire(x.clone(), "int8", error_feedback=True, residual=kept)
    before = kept.sent.clone()
    backend.piece_bytes = 8192
    y, z = x.clone(), x.clone()
    backend.allreduce_wire(y, "int8", error_feedback=True, residual=kept)
    backend.allreduce_wire(z, "int8", error_feedback=True, residual=pycomm._C.WireResidual())
    assert kept.sent.numel() == before.numel()
    assert torch.equal(y, z), "a residual of another layout was carried over"


def test_a_residual_restarts_when_the_layout_changes():
    run_ranks(_layout, world_size=4)


def test_wire_names_are_checked():
    assert pycomm.Wire("int8", True).name == "int8+ef"
    with pytest.raises(ValueError, match="wire must be 'fp32', 'bf16' or 'int8'.*'fp16'"):
        pycomm.DDPConfig(wire="fp16")
    with pytest.raises(ValueError, match="wire_error_feedback needs wire='int8'"):
        pycomm.DDPConfig(wire="bf16", wire_error_feedback=True)
    with pytest.raises(ValueError, match="hierarchical_allreduce=True"):
        pycomm.DDPConfig(wire="bf16", hierarchical_allreduce=False)
    assert pycomm._C.wire_bytes("int8", 512) == 2 * 4 + 512
    assert pycomm._C.wire_bytes("bf16", 3) == 8


def _ddp_wire(rank, world, per_host, wire, feedback):
    _pretend_hosts(rank, per_host)
    torch.manual_seed(0)
    ours = pycomm.DistributedDataParallel(
        build("mlp"), config=pycomm.DDPConfig(bucket_cap_mb=0.002, wire=wire,
                                              wire_error_feedback=feedback))
    torch.manual_seed(0)
    exact = pycomm.DistributedDataParallel(build("mlp"),
                                           config=pycomm.DDPConfig(bucket_cap_mb=0.002))
    assert ours.reducer.wire == wire + ("+ef" if feedback else "")
    assert exact.reducer.wire == "fp32"
    assert len(ours.reducer.bucket_indices()) > 1
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        for model in (ours, exact):
            model.zero_grad()
            model(x).pow(2).mean().backward()
        for (name, a), b in zip(ours.module.named_parameters(), exact.module.parameters()):
            assert all(torch.equal(t, a.grad) for t in _gathered(a.grad, world)), name
            rel = ((a.grad - b.grad).norm() / b.grad.norm()).item()
            assert rel < (0.01 if wire == "bf16" else 0.15), (name, rel)
    # The flight record's entries for the shared-memory phases name the wire; with one
    # rank per host there are none (Note [One rank per host] in csrc/shm/hier_allreduce.cpp)
    name = wire + ("+ef" if feedback else "")
    ops = {e["op"] for e in pycomm.shm.flight_record(ours.gradient_group)}
    phases = {f"reduce_scatter_tensor[wire={name}]", f"all_gather_into_tensor[wire={name}]"}
    assert (not phases & ops) if max(per_host) == 1 else phases <= ops, ops
    with pytest.raises(RuntimeError, match="register_comm_hook.*wire="):
        ours.register_comm_hook(None, lambda s, b: None)
    with pytest.raises(ValueError, match="parameter 'net.0.weight' is float64"):
        pycomm.DistributedDataParallel(build("mlp").double(),
                                       config=pycomm.DDPConfig(wire=wire))
    with pytest.raises(ValueError, match="parameter 'net.0.weight' is reduced in float64"):
        pycomm.DistributedDataParallel(build("mlp").bfloat16(), config=pycomm.DDPConfig(
            wire=wire, grad_reduce_dtype=torch.float64))
    # The sharded optimizer with its gradients kept steps on what the wire delivered
    # (released, its reduce-scatter carries the wire: test_wire_sharded.py).
    zero = pycomm.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-3)
    ours.zero_grad()
    ours(torch.randn(8, 8)).pow(2).mean().backward()
    zero.step()
    zero.wait_for_params()
    for p in ours.module.parameters():
        assert all(torch.equal(t, p) for t in _gathered(p.detach(), world))


@pytest.mark.parametrize("per_host,wire,feedback", [([2, 2], "bf16", False),
                                                    ([2, 2], "int8", True),
                                                    ([1, 1], "int8", False)],
                         ids=["2x2-bf16", "2x2-int8+ef", "2x1-int8"])
def test_ddp_sends_gradients_in_the_wire(per_host, wire, feedback):
    run_ranks(_ddp_wire, world_size=sum(per_host), per_host=per_host, wire=wire,
              feedback=feedback)


def _one_host(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = pycomm.DistributedDataParallel(build("mlp"),
                                             config=pycomm.DDPConfig(wire="bf16"))
    assert any("no gradient crosses a host" in str(w.message) for w in caught)
    assert ddp.reducer.wire == "fp32"
    # nothing crosses a host, so nothing stops a comm hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp.register_comm_hook(None, allreduce_hook)
    assert ddp.reducer.wire is None  # the hook decides what crosses


def test_on_one_host_the_wire_changes_nothing_and_says_so():
    run_ranks(_one_host, world_size=2)


def _twin(base, wire, feedback=False):
    return pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=0.002, wire=wire,
                                                     wire_error_feedback=feedback))


def _features(rank, world, wire, feedback, tol):
    """The wire under DDP's features, against the same DDP in float32 on the same inputs:
    no_sync accumulation, the DDP's clip from bucket norms, join with uneven inputs and
    torch.compile; every rank ends with the same bits, and the gradients and parameters
    within the wire's rounding of float32's."""
    _pretend_hosts(rank, [2, 2])
    torch.manual_seed(0)
    base = build("mlp")
    models = {"low": _twin(base, wire, feedback), "fp32": _twin(base, "fp32")}
    opts = {w: torch.optim.SGD(m.parameters(), lr=0.1) for w, m in models.items()}
    for w, m in models.items():
        x = [torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * i + rank))
             for i in range(3)]
        with m.no_sync():  # accumulated locally: nothing crosses
            m(x[0]).pow(2).mean().backward()
        m(x[1]).pow(2).mean().backward()
        norm = m.clip_grad_norm_(0.01)
        assert norm > 0.01, "the test must clip"
        opts[w].step()
        # join: rank 3 runs out of batches first, the others shadow nothing it misses
        with m.join():
            for step in range(2 + (rank < 3)):
                opts[w].zero_grad()
                m(x[step]).pow(2).mean().backward()
                opts[w].step()
    for (name, a), b in zip(models["low"].module.named_parameters(),
                            models["fp32"].module.parameters()):
        assert all(torch.equal(t, a) for t in _gathered(a.detach(), world)), name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol / 10, msg=name)
    # torch.compile: the compiled module's buckets cross in the wire too
    compiled = torch.compile(models["low"], backend="aot_eager")
    models["low"].zero_grad()
    compiled(torch.randn(8, 8)).pow(2).mean().backward()
    assert models["low"].reducer.wire == wire + ("+ef" if feedback else "")
    for p in models["low"].module.parameters():
        assert all(torch.equal(t, p.grad) for t in _gathered(p.grad, world))


@pytest.mark.parametrize("wire,feedback,tol", [("bf16", False, 1e-2), ("int8", True, 5e-2)],
                         ids=["bf16", "int8+ef"])
def test_wire_with_no_sync_clip_join_and_compile(wire, feedback, tol):
    run_ranks(_features, world_size=4, wire=wire, feedback=feedback, tol=tol)


def _host_dies(rank, world, op):
    """Host 1's first rank exits during a wire collective (`op`: the all-reduce in bf16, or
    the reduce-scatter in int8): every other rank's fails within the group timeout, naming
    the wire, the hierarchy and the phase."""
    _, backend = _wire_backend(rank, [2, 2])
    if op == "all_reduce":
        name = r"all_reduce\[wire=bf16\]"

        def run(n):
            backend.allreduce_wire(torch.ones(n), "bf16")
    else:
        name = r"reduce_scatter_tensor\[wire=int8\]"

        def run(n):
            n -= n % world
            backend.reduce_scatter_wire(torch.empty(n // world), torch.ones(n), "int8")
    run(1000)  # a healthy one first
    if rank == 2:
        exit_rank()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"pycomm {name} #\d+ "
                                           r"\(hierarchical.*on rank \d \(host \d of 2"):
        run(8 << 20)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_a_dead_host_is_named_in_the_wire_collectives(op):
    run_ranks(_host_dies, world_size=4, group_timeout_s=6, op=op)


def test_the_wire_is_one_value():
    """Note [The wire as a value]: parsed once where it is named, then compared, hashed,
    pickled and asked whole; DDPConfig holds it parsed."""
    wire = pycomm.Wire("int8", error_feedback=True)
    assert wire == "int8+ef" and wire == pycomm.Wire(pycomm.WireDtype.INT8, True)
    assert wire != "int8" and wire != pycomm.Wire("int8") and wire != 3
    assert {wire: 1}[pycomm.Wire("int8", True)] == 1 and hash(wire) == hash("int8+ef")
    assert pickle.loads(pickle.dumps(wire)) == wire
    assert repr(wire) == "pycomm.Wire('int8', error_feedback=True)" and str(wire) == "int8+ef"
    assert (wire.dtype, wire.error_feedback, wire.exact) == (pycomm.WireDtype.INT8, True, False)
    assert pycomm.Wire().exact and pycomm.Wire() == "fp32"
    assert [pycomm.Wire("bf16").carries(d) for d in
            (torch.float32, torch.bfloat16, torch.float16, torch.float64)] == [1, 1, 1, 0]
    assert pycomm.Wire("fp32").carries(torch.float64)
    with pytest.raises(ValueError, match="wire_error_feedback needs wire='int8'"):
        pycomm.Wire(pycomm.WireDtype.BF16, error_feedback=True)
    config = pycomm.DDPConfig(wire="int8", wire_error_feedback=True)
    assert config.wire_format == wire
    assert config.replace(wire_error_feedback=False).wire_format == "int8"
    assert pickle.loads(pickle.dumps(config)) == config
    older = pycomm.DDPConfig(wire="bf16")  # as pickled before wire_format existed
    del older.__dict__["wire_format"]
    assert pickle.loads(pickle.dumps(older)).wire_format == "bf16"
    # float64 buckets are refused by the DDP that would send them, naming the parameter
    # (test_ddp_sends_gradients_in_the_wire); where nothing crosses a host they are fine
    assert not pycomm.DDPConfig(wire="bf16", grad_reduce_dtype=torch.float64).wire_format.exact
