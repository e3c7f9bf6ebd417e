"""DDP buckets reduced where their gradients are (Note [Gradients reduced in place] in
csrc/reducer/in_place.cpp): over the shared-memory group every bucket goes in place by
default and param.grad gets the very bits of the bucketed path (and of torch's DDP at 2
ranks); what needs the bucket's memory keeps a bucket on its buffer, for the step or for
good, and the per-bucket timeline says which way each bucket went."""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks

TINY, ONE = 1e-6, 1000.0  # bucket caps: one parameter per bucket, one bucket


def _in_place(ddp) -> list[bool]:
    return [b["in_place"] for b in ddp.timelines(1)[0]["buckets"]]


def _on_buffer(ddp) -> list[list[int]]:
    """The parameter indices of the buckets of the last step not reduced in place."""
    return [b["param_indices"] for b in ddp.timelines(1)[0]["buckets"] if not b["in_place"]]


def _train(ddp, model, rank, steps=3, before_backward=None):
    """Per step, every parameter's gradient after backward, and which buckets went in place."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    grads, ways = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=before_backward is None)
        if before_backward is not None:
            before_backward(ddp)
        loss_of(ddp(make_input(model, rank, step))).backward()
        grads.append([p.grad.detach().clone() for p in ddp.parameters()])
        if isinstance(ddp, pycomm.DistributedDataParallel):
            ways.append((_in_place(ddp), _on_buffer(ddp)))
        opt.step()
    return grads, ways


def _pair(model, **kwargs):
    base = build(model)
    on = pycomm.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    off = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(in_place_reduction=False, **kwargs))
    return base, on, off


def _assert_equal(a, b, what):
    for step, (x, y) in enumerate(zip(a, b)):
        for i, (g, h) in enumerate(zip(x, y)):
            assert torch.equal(g, h), f"{what}: step {step}, parameter {i}"


def _same_as_through_the_bucket(on, off, model, rank, what):
    """`on` and `off` trained alike: param.grad bitwise equal every step, every bucket of
    `on` in place and none of `off`'s. Returns `on`'s gradients."""
    got, ways_on = _train(on, model, rank)
    want, ways_off = _train(off, model, rank)
    _assert_equal(got, want, what)
    assert all(all(w) for w, _ in ways_on), f"{what}: {ways_on}"
    assert not any(any(w) for w, _ in ways_off), f"{what}: {ways_off}"
    return got


def _same_bits(rank, world):
    for model in ("wide", "mlp", "attn", "convbn", "tied"):
        for cap in (TINY, None, ONE):
            kwargs = {} if cap is None else {"bucket_cap_mb": cap}
            base, on, off = _pair(model, **kwargs)
            what = f"{model} cap={cap} world={world}"
            got = _same_as_through_the_bucket(on, off, model, rank, what)
            if world == 2:  # a*(1/2) + b*(1/2): exact in any order, so torch's bits too
                ref, _ = _train(TorchDDP(copy.deepcopy(base), **kwargs), model, rank)
                _assert_equal(got, ref, f"{what} against torch")


def test_same_bits_as_through_the_bucket_2_ranks():
    run_ranks(_same_bits, 2)


def test_same_bits_as_through_the_bucket_3_ranks():
    run_ranks(_same_bits, 3)


def _one_rank(rank, world):
    """Note [One rank reduces nothing] (csrc/reducer/comm_hook.cpp): on a group of one rank
    every bucket goes in place on either group, Gloo's too, and nothing touches the
    gradients: param.grad is the tensor autograd made, with torch's DDP's bits; join's
    divisor still scales them."""
    for shm in (True, False):
        for model in ("wide", "mlp", "attn"):
            for cap in (TINY, ONE):
                base = build(model)
                on = pycomm.DistributedDataParallel(
                    copy.deepcopy(base),
                    config=pycomm.DDPConfig(shared_memory_gradients=shm, bucket_cap_mb=cap))
                got, ways = _train(on, model, rank)
                what = f"{model} cap={cap} shm={shm}"
                assert all(all(w) for w, _ in ways), f"{what}: {ways}"
                ref, _ = _train(TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap), model, rank)
                _assert_equal(got, ref, f"{what} against torch")
        # no copy: the gradient autograd accumulated into is the one left in param.grad
        ddp = pycomm.DistributedDataParallel(
            build("mlp"), config=pycomm.DDPConfig(shared_memory_gradients=shm))
        made = {}
        for p in ddp.parameters():
            p.register_post_accumulate_grad_hook(
                lambda q, made=made: made.__setitem__(id(q), q.grad))
        loss_of(ddp(make_input("mlp", rank, 0))).backward()
        for name, p in ddp.module.named_parameters():
            assert p.grad is made[id(p)], f"shm={shm}: {name}'s gradient was replaced"
    # a divisor other than 1 (set by join() when ranks have left) still scales
    ddp = pycomm.DistributedDataParallel(build("mlp"))
    ddp.reducer.set_divide_factor(2)
    grads, _ = _train(ddp, "mlp", rank, steps=1)
    plain = build("mlp")
    loss_of(plain(make_input("mlp", rank, 0))).backward()
    for g, p in zip(grads[0], plain.parameters()):
        assert torch.equal(g, p.grad * 0.5)


def test_one_rank_leaves_the_gradients_alone():
    run_ranks(_one_rank, 1)


def _strided_grad(ddp):
    """fc1.weight's gradient kept in a transposed (non-contiguous) tensor across steps."""
    w = ddp.module.net[0].weight
    w.grad = torch.zeros(w.shape[1], w.shape[0]).t()


def _shared_grads(ddp):
    """Both hidden biases' gradients in one tensor."""
    net = ddp.module.net
    net[0].bias.grad = net[2].bias.grad = torch.zeros_like(net[0].bias)


def _what_keeps_the_bucket(rank, world):
    model = "mlp"
    # For good: gradient_as_bucket_view, a Python bucket callback, a Gloo group.
    for kwargs in ({"gradient_as_bucket_view": True}, {"shared_memory_gradients": False}):
        base = build(model)
        ddp = pycomm.DistributedDataParallel(copy.deepcopy(base),
                                             config=pycomm.DDPConfig(**kwargs))
        _, ways = _train(ddp, model, rank)
        assert not any(any(w) for w, _ in ways), (kwargs, ways)
    base, on, off = _pair(model)
    on.reducer.add_post_done(lambda index, buffer: None)
    got, ways = _train(on, model, rank)
    assert not any(any(w) for w, _ in ways), ways
    _assert_equal(got, _train(off, model, rank)[0], "with a bucket callback")
    # For the step: two gradients sharing memory (a user's q.grad = p.grad), in one
    # bucket and in two.
    for cap in (ONE, TINY):
        base, on, off = _pair(model, bucket_cap_mb=cap)
        got, ways = _train(on, model, rank, before_backward=_shared_grads)
        assert not any(any(w) for w, _ in ways), ways
        _assert_equal(got, _train(off, model, rank, before_backward=_shared_grads)[0],
                      f"shared, cap {cap}")
    # Per bucket: a gradient laid out unlike its slot sends its own bucket (one parameter
    # each here) back to the buffer, the others stay in place; in one bucket, the switch
    # comes after other gradients were left in place, which are then copied in.
    index = [name for name, _ in build(model).named_parameters()].index("net.0.weight")
    for cap in (TINY, ONE):
        base, on, off = _pair(model, bucket_cap_mb=cap)
        got, ways = _train(on, model, rank, before_backward=_strided_grad)
        assert not on.module.net[0].weight.grad.is_contiguous()
        everything = [list(range(len(list(on.parameters()))))]
        for _, on_buffer in ways:
            assert [sorted(b) for b in on_buffer] == ([[index]] if cap == TINY
                                                      else everything), ways
        _assert_equal(got, _train(off, model, rank, before_backward=_strided_grad)[0],
                      f"strided, cap {cap}")


def _transposed_weight(model):
    """net.0.weight with transposed strides (dense): its bucket slot has them too."""
    w = model.net[0].weight
    model.net[0].weight = torch.nn.Parameter(w.detach().t().contiguous().t())
    return model


def _mixed_paths(rank, world, config=None, prepare=None):
    """Rank 0 keeps a transposed weight's gradient in a contiguous tensor (its bucket goes
    through the buffer), the others let autograd lay it out like the weight (in place):
    every rank adds the same elements together, in the slot's memory order, and gets the
    all-buffer run's bits. `config`: more DDPConfig options; `prepare(ddp)`: called on the
    in-place DDP before it trains."""
    base = _transposed_weight(build("mlp"))
    on, off = (pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=TINY, **(config or {}),
                                                     **extra))
        for extra in ({}, {"in_place_reduction": False}))
    if prepare is not None:
        prepare(on)

    def contiguous_grad(ddp):
        if rank == 0:
            w = ddp.module.net[0].weight
            w.grad = torch.zeros(w.shape)

    index = [name for name, _ in base.named_parameters()].index("net.0.weight")
    got, ways = _train(on, "mlp", rank, before_backward=contiguous_grad)
    for _, on_buffer in ways:
        assert on_buffer == ([[index]] if rank == 0 else []), (rank, ways)
    _assert_equal(got, _train(off, "mlp", rank, before_backward=contiguous_grad)[0],
                  f"mixed, {config}")


def test_ranks_on_different_paths_add_the_same_elements():
    run_ranks(_mixed_paths, 2)


def test_what_keeps_a_bucket_on_its_buffer():
    run_ranks(_what_keeps_the_bucket, 2)
