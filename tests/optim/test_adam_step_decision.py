"""When the one-pass Adam decides whether it applies (Note [Deciding once, checking each
step] in pycomm/adam_step.py): the walk of the parameters once per layout, not every
step; made again when a group is added or a state is loaded; the options, the hooks and
this step's gradients checked every step, so never stale; torch's bits throughout. The
walks are counted by wrapping adam_step._params_reason, the one function that walks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import pycomm
from pycomm import adam_step
from pycomm.optim import ONE_PASS_STEP

SIZES = ((30, 4), (4,), (513,), (7, 5))


@pytest.fixture
def walks(monkeypatch):
    """The optimizers whose parameters were walked, one entry a walk."""
    seen = []
    real = adam_step._params_reason

    def counted(optim):
        seen.append(optim)
        return real(optim)

    monkeypatch.setattr(adam_step, "_params_reason", counted)
    return seen


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SIZES]


def _pair(make=pycomm.optim.AdamW, **options):
    """torch's AdamW and `make`'s over equal parameters, in two groups."""
    theirs, ours = _params(), _params()

    def groups(ps):
        return [{"params": ps[:2], "lr": 3e-3}, {"params": ps[2:]}]

    return theirs, ours, torch.optim.AdamW(groups(theirs), **options), make(groups(ours),
                                                                            **options)


def _give_grads(theirs, ours, step):
    g = torch.Generator().manual_seed(100 + step)
    for a, b in zip(theirs, ours):
        grad = (torch.randn(a.shape, generator=g) * 10.0 ** (step % 3 - 1)).to(a.dtype)
        grad.view(-1)[: a.numel() // 4] = 0.0
        a.grad, b.grad = grad, grad.clone()


def _steps(theirs, ours, ref, mine, first, count):
    for k in range(first, first + count):
        _give_grads(theirs, ours, k)
        ref.step()
        mine.step()


def _assert_same(theirs, ours, ref, mine):
    assert len(ref.state) == len(mine.state)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert torch.equal(a, b), f"param {i}"
        assert list(ref.state[a]) == list(mine.state[b])
        for key, value in ref.state[a].items():
            assert value.dtype == mine.state[b][key].dtype, (key, i)
            assert torch.equal(value, mine.state[b][key]), f"{key} of param {i}"


def test_a_steady_step_does_not_walk_the_parameters(walks):
    """Ten steps under an LR scheduler (group["lr"] written every step): one walk, at the
    first step; the kernel steps every time, with torch's bits."""
    theirs, ours, ref, mine = _pair(weight_decay=0.05)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8) for o in (ref, mine)]
    for k in range(11):
        _steps(theirs, ours, ref, mine, k, 1)
        for s in scheds:
            s.step()
        assert mine.step_kernel == ONE_PASS_STEP
        assert len(walks) == 1, f"step {k + 1} walked the parameters"
    _assert_same(theirs, ours, ref, mine)


def test_in_place_of_step_hooks_are_checked_every_step_and_walks_are_not(walks):
    """The sharded optimizer's way (try_step in place of step()): steady steps do not walk;
    a step hook, the optimizer's or torch's global one, registered between two steps
    keeps the kernel off from the next step on; removed, the kernel steps again."""
    theirs, ours, ref, mine = _pair(torch.optim.AdamW)
    for k in range(10):
        _give_grads(theirs, ours, k)
        ref.step()
        assert adam_step.try_step(mine) is None
    assert len(walks) == 1
    for register, expect in ((mine.register_step_pre_hook, "optimizer step hooks"),
                             (register_optimizer_step_pre_hook, "global optimizer step hooks")):
        handle = register(lambda *args: None)
        try:
            _give_grads(theirs, ours, 10)
            why = adam_step.try_step(mine)
            assert why is not None and expect in why, why
        finally:
            handle.remove()
        _give_grads(theirs, ours, 11)
        ref.step()
        assert adam_step.try_step(mine) is None
    _assert_same(theirs, ours, ref, mine)


def test_the_walk_is_made_again_when_a_group_is_added(walks):
    """add_param_group: the next step walks once (a frozen float64 parameter, which only
    the walk sees, then keeps the kernel off); torch's bits either way."""
    theirs, ours, ref, mine = _pair()
    _steps(theirs, ours, ref, mine, 0, 3)
    assert len(walks) == 1
    for new in ([nn.Parameter(torch.randn(9))],
                [torch.zeros(3, dtype=torch.float64, requires_grad=True)]):
        twins = [nn.Parameter(p.detach().clone()) for p in new]
        ref.add_param_group({"params": new, "lr": 2e-3})
        mine.add_param_group({"params": twins, "lr": 2e-3})
        if new[0].dtype == torch.float32:  # the frozen one never gets a gradient
            theirs += new
            ours += twins
        _steps(theirs, ours, ref, mine, 3, 3)
        assert len(walks) == 2 or new[0].dtype == torch.float64
    assert "torch.float64" in mine.step_kernel, mine.step_kernel
    _assert_same(theirs, ours, ref, mine)


def test_the_walk_is_made_again_when_a_state_is_loaded(walks):
    """load_state_dict: the next step walks once. A loaded state with a key torch's step
    does not make (only the walk sees it) keeps the kernel off; torch's own state loaded
    again, the kernel steps on."""
    theirs, ours, ref, mine = _pair()
    _steps(theirs, ours, ref, mine, 0, 3)
    saved = ref.state_dict()
    saved["state"][1]["max_exp_avg_sq"] = torch.zeros(SIZES[1])
    for o in (ref, mine):  # a copy each: a load keeps the dict's tensors as they are
        o.load_state_dict(copy.deepcopy(saved))
    _steps(theirs, ours, ref, mine, 3, 1)
    assert len(walks) == 2
    assert "a state of ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step']" in mine.step_kernel
    saved = ref.state_dict()
    del saved["state"][1]["max_exp_avg_sq"]
    for o in (ref, mine):
        o.load_state_dict(copy.deepcopy(saved))
    _steps(theirs, ours, ref, mine, 4, 3)
    assert mine.step_kernel == ONE_PASS_STEP
    assert len(walks) == 3  # one after each load; none in the steps after the second
    _assert_same(theirs, ours, ref, mine)


@pytest.mark.parametrize("key, value, expect", [
    ("maximize", True, "maximize"),
    ("foreach", True, "foreach"),
    ("lr", torch.tensor(1e-3), "tensor hyperparameter"),
    ("amsgrad", True, "amsgrad"),
], ids=["maximize", "foreach", "tensor-lr", "amsgrad"])
def test_a_group_option_changed_between_steps_is_caught_at_the_next(walks, key, value,
                                                                     expect):
    """A group's option set to one the kernel does not take, after steady steps: the next
    step is torch's (amsgrad on a state made without it: torch's KeyError, from both);
    set back, the kernel steps again; torch's bits throughout."""
    theirs, ours, ref, mine = _pair()
    _steps(theirs, ours, ref, mine, 0, 3)
    before = [g[key] for g in mine.param_groups]
    for o in (ref, mine):
        o.param_groups[1][key] = value
    why = adam_step.decide(mine, mine.one_pass_of)
    assert why is not None and expect in why, why
    _give_grads(theirs, ours, 3)
    if key == "amsgrad":  # torch's step reads a max_exp_avg_sq its state never made
        for o in (ref, mine):
            with pytest.raises(KeyError, match="max_exp_avg_sq"):
                o.step()
    else:
        ref.step()
        with pytest.warns(UserWarning, match=expect):
            mine.step()
        assert expect in mine.step_kernel
    for o in (ref, mine):
        o.param_groups[1][key] = before[1]
    _steps(theirs, ours, ref, mine, 4, 2)
    assert mine.step_kernel == ONE_PASS_STEP
    _assert_same(theirs, ours, ref, mine)


def test_this_step_s_tensors_are_checked_by_the_kernel(walks):
    """Under a remembered walk, what changes in place is the kernel's to refuse, before it
    writes anything, and torch's step runs: one step's gradient not contiguous, then a
    parameter's .data made column-major in place."""
    theirs, ours, ref, mine = _pair()
    _steps(theirs, ours, ref, mine, 0, 2)
    assert len(walks) == 1
    _give_grads(theirs, ours, 2)
    theirs[0].grad = torch.randn(SIZES[0][::-1]).t()
    ours[0].grad = theirs[0].grad.clone()  # as strided
    ref.step()
    with pytest.warns(UserWarning, match="gradient that is not contiguous"):
        mine.step()
    assert "gradient that is not contiguous" in mine.step_kernel
    assert len(walks) == 2  # the walk that named the reason, after the kernel refused
    _steps(theirs, ours, ref, mine, 3, 2)
    assert mine.step_kernel == ONE_PASS_STEP
    for p in (theirs[0], ours[0]):
        p.data = p.data.t().contiguous().t()
    _steps(theirs, ours, ref, mine, 5, 1)
    assert "not contiguous" in mine.step_kernel, mine.step_kernel
    _assert_same(theirs, ours, ref, mine)


def test_a_refused_step_keeps_no_state_it_made():
    """The kernel refuses a gradient of a parameter without a state: step() raises and
    leaves no state behind (torch's step, run next, makes its own)."""
    p, q = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p, q])
    p.grad, q.grad = torch.randn(6), torch.randn(4, 4).t()
    with pytest.raises(RuntimeError, match=r"grads\[1\] must be a contiguous float32"):
        adam_step.step(opt)
    assert len(opt.state) == 0
    why = adam_step.try_step(opt)
    assert why is not None and "gradient that is not contiguous" in why, why
    assert len(opt.state) == 0
