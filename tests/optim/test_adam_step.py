"""The one-pass Adam of pycomm.optim and the sharded optimizer (pycomm/adam_step.py, the
kernel in csrc/grad/adam_cpu.cpp): torch's own Adam / AdamW step, bit for bit, on every
form of the update it takes; a refusal, naming why, for every other; the probe that keeps
it off where it would differ; the kernel's argument errors."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import pycomm
from pycomm import adam_step

# lengths that cross vectors, remainders, the MKL route's 512-element chunks and the
# kernel's 32 Ki-element blocks
LENGTHS = (1, 7, 37, 511, 512, 1025, 4099, (1 << 15) + 5, 3 * (1 << 15))
ROUTES = ("mkl", "aten")  # Note [Adam in chunks, two at a time] in csrc/grad/adam_cpu.cpp


@pytest.fixture(params=ROUTES)
def route(request):
    """The kernel's square roots through MKL directly, or ATen's call; put back after."""
    try:
        pycomm._C._adam_route(request.param)
    except ValueError as e:
        pytest.skip(f"this build cannot take the MKL route: {e}")
    yield request.param
    pycomm._C._adam_route("auto")

_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters
FORMS = {
    "adamw": (torch.optim.AdamW, {}),
    "adamw-no-decay": (torch.optim.AdamW, {"weight_decay": 0.0}),
    "adamw-large-lerp-weight": (torch.optim.AdamW, {"betas": (0.3, 0.99), "eps": 1e-6}),
    "adam": (torch.optim.Adam, {}),
}
if _DECOUPLED:
    FORMS["adam-decoupled"] = (torch.optim.Adam, {"weight_decay": 0.1,
                                                 "decoupled_weight_decay": True})


def _grads(generator, step, lengths):
    """Gradients over several magnitudes; a quarter of each exactly zero every step (its
    exp_avg_sq stays zero: Note [Zeros around the square root]), one element -0.0."""
    out = []
    for n in lengths:
        g = torch.randn(n, generator=generator) * 10.0 ** (step % 4 - 2)
        g[: n // 4] = 0.0
        if n >= 4:
            g[n // 4 - 1] = -0.0
        out.append(g)
    return out


def _assert_same(theirs, ours, ref, mine, where):
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert torch.equal(a, b), f"{where}: param {i} ({a.numel()} elements)"
        sa, sb = ref.state[a], mine.state[b]
        assert set(sa) == set(sb), (sorted(sa), sorted(sb))
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, (key, sa[key].dtype, sb[key].dtype)
            assert torch.equal(sa[key], sb[key]), f"{where}: {key} of param {i}"


@pytest.mark.parametrize("form", list(FORMS))
def test_bitwise_torch_over_steps_and_a_schedule(form, route):
    """Eight steps, the learning rate changed between them as a scheduler would, two
    groups: every parameter and state tensor equals the optimizer's own step's."""
    cls, options = FORMS[form]
    generator = torch.Generator().manual_seed(0)
    theirs = [torch.randn(n, generator=generator) for n in LENGTHS]
    ours = [t.clone() for t in theirs]

    def groups(ps):
        return [{"params": ps[:3], "lr": 3e-3}, {"params": ps[3:]}]

    ref = cls(groups(theirs), lr=1e-3, **options)
    mine = cls(groups(ours), lr=1e-3, **options)
    assert adam_step.reason(mine) is None
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        assert pycomm._C._cpu_kernels() == "default"
    for step in range(8):
        for a, b, g in zip(theirs, ours, _grads(generator, step, LENGTHS)):
            a.grad, b.grad = g, g.clone()
        if step == 5:  # a parameter without a gradient this step: neither steps it
            theirs[1].grad = ours[1].grad = None
        ref.step()
        adam_step.step(mine)
        _assert_same(theirs, ours, ref, mine, f"{form}, step {step + 1}")
        for r, m in zip(ref.param_groups, mine.param_groups):
            r["lr"] = m["lr"] = r["lr"] * 0.7


def test_bitwise_at_two_threads_across_tasks(route):
    """Tensors larger than a task's 8 blocks and smaller than one, stepped at 2 threads:
    a task's span starts and ends inside tensors, and the bits are torch's."""
    lengths = (9 * (1 << 15) + 3, 5, 300_001)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(3)
        theirs = [torch.randn(n, generator=generator) for n in lengths]
        ours = [t.clone() for t in theirs]
        ref, mine = torch.optim.AdamW(theirs, lr=1e-3), torch.optim.AdamW(ours, lr=1e-3)
        for step in range(3):
            for a, b, g in zip(theirs, ours, _grads(generator, step, lengths)):
                a.grad, b.grad = g, g.clone()
            ref.step()
            adam_step.step(mine)
            _assert_same(theirs, ours, ref, mine, f"{route} at 2 threads, step {step + 1}")
    finally:
        torch.set_num_threads(threads)


def test_route_default_and_errors():
    """MKL's square root is called directly where torch links MKL (this CI's wheel does);
    a route not known is refused by name."""
    if torch.backends.mkl.is_available():
        assert pycomm._C._adam_route("auto") == "mkl"
    assert pycomm._C._adam_route() in ROUTES
    with pytest.raises(ValueError, match='want must be "", "auto", "mkl" or "aten", got "x"'):
        pycomm._C._adam_route("x")


def test_state_from_either_step_continues_in_the_other():
    """The state is torch's: a state dict saved after the one-pass step loads into a
    plain AdamW that steps on, and the other way round, bitwise with one run throughout."""
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(n, generator=generator) for n in LENGTHS]
    grads = [_grads(generator, k, LENGTHS) for k in range(6)]
    ps = [[t.clone() for t in start] for _ in range(3)]
    opts = [torch.optim.AdamW(p, lr=1e-2) for p in ps]
    for k in range(6):
        for which, (p, opt) in enumerate(zip(ps, opts)):
            for t, g in zip(p, grads[k]):
                t.grad = g.clone()
            one_pass = (which == 1 and k < 3) or (which == 2 and k >= 3)
            adam_step.step(opt) if one_pass else opt.step()
        if k == 2:  # hand each run's state to a fresh optimizer of the same parameters
            for which in (1, 2):
                fresh = torch.optim.AdamW(ps[which], lr=1e-2)
                fresh.load_state_dict(opts[which].state_dict())
                opts[which] = fresh
    for which in (1, 2):
        _assert_same(ps[0], ps[which], opts[0], opts[which], f"run {which}")


def test_nonfinite_gradients_give_torch_s_nonfinite_values():
    p = [torch.randn(64)]
    q = [p[0].clone()]
    ref, mine = torch.optim.AdamW(p, lr=1e-2), torch.optim.AdamW(q, lr=1e-2)
    g = torch.randn(64)
    g[3], g[10], g[40] = float("inf"), float("-inf"), float("nan")
    p[0].grad, q[0].grad = g, g.clone()
    ref.step()
    adam_step.step(mine)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ref.state[p[0]][key], mine.state[q[0]][key], rtol=0, atol=0,
                                   equal_nan=True)
    torch.testing.assert_close(p[0], q[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("make, expect", [
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.AdamW(ps, maximize=True), "maximize"),
    (lambda ps: torch.optim.AdamW(ps, foreach=True), "foreach"),
    (lambda ps: torch.optim.AdamW(ps, fused=True), "fused"),
    (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-3)), "tensor hyperparameter"),
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "L2 weight decay"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "SGD is not torch's Adam or AdamW"),
    (lambda ps: torch.optim.AdamW([p.double() for p in ps]), "torch.float64"),
], ids=["amsgrad", "maximize", "foreach", "fused", "tensor-lr", "adam-l2", "sgd", "float64"])
def test_refusals_name_the_reason(make, expect):
    """Anything beyond the plain update steps itself; reason() says which option."""
    opt = make([torch.randn(8)])
    why = adam_step.reason(opt)
    assert why is not None and expect in why, why


@pytest.mark.parametrize("spoil, expect", [
    (lambda o, p: setattr(p, "grad", torch.randn(4, 4).t()), "gradient that is not contiguous"),
    (lambda o, p: o.state[p].update(step=torch.tensor(3)), "step counter of torch.int64"),
    (lambda o, p: o.state[p].update(exp_avg=o.state[p]["exp_avg"].double()),
     "state tensor that is not contiguous float32"),
    (lambda o, p: torch.optim.lr_scheduler.StepLR(o, 1), "step() is wrapped"),
    (lambda o, p: o.param_groups[0].update(betas=(1.0, 0.999)), "beta1 = 1"),
], ids=["strided-grad", "int64-step", "float64-state", "scheduler-on-it", "beta1-one"])
def test_what_torch_steps_but_the_kernel_does_not_take_falls_back(spoil, expect):
    """What a checkpoint or a user may leave (a strided gradient, an int64 step counter,
    state of another dtype, a scheduler that counts the optimizer's own calls, beta1 = 1,
    where torch raises ZeroDivisionError): refused with the reason, so torch's step runs."""
    p = torch.randn(4, 4)
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(4, 4)
    opt.step()
    spoil(opt, p)
    why = adam_step.reason(opt)
    assert why is not None and expect in why, why


def test_kernel_refuses_beta1_of_one_before_writing():
    p, g, m, v, s = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4), torch.zeros(())
    hyper = torch.tensor([[1e-3, 1.0, 0.999, 1e-8, 0.01]], dtype=torch.float64)
    with pytest.raises(ValueError, match="divides by zero"):
        torch.ops.pycomm.adam_step_([p], [g], [m], [v], [s], hyper)
    assert float(s) == 0.0 and torch.equal(p, torch.ones(4)) and not m.any()


def test_the_step_marks_what_it_wrote_for_autograd():
    """As torch's in-place operations do: a graph that saved the parameter before the step
    refuses to backward through it after."""
    q = torch.randn(10, requires_grad=True)
    opt = torch.optim.AdamW([q], lr=1e-3)
    loss = (q * q).sum()
    q.grad = torch.ones(10)
    before = q._version
    adam_step.step(opt)
    assert q._version > before
    assert all(t._version > 0 for t in opt.state[q].values())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_float64_default_dtype_still_probes_float32():
    """torch.set_default_dtype(torch.float64) before a float32 model: the probe's tensors
    stay float32, the step counter follows the default dtype as torch's does."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        adam_step._verdicts.clear()
        theirs = [torch.randn(37, dtype=torch.float32)]
        ours = [theirs[0].clone()]
        ref, mine = torch.optim.AdamW(theirs), torch.optim.AdamW(ours)
        assert adam_step.reason(mine) is None
        for _ in range(2):
            theirs[0].grad = torch.randn(37, dtype=torch.float32)
            ours[0].grad = theirs[0].grad.clone()
            ref.step()
            adam_step.step(mine)
        _assert_same(theirs, ours, ref, mine, "float64 default dtype")
        assert mine.state[ours[0]]["step"].dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
        adam_step._verdicts.clear()


def test_step_hooks_keep_the_optimizer_s_own_step():
    opt = torch.optim.AdamW([torch.randn(8)])
    handle = opt.register_step_pre_hook(lambda *args: None)
    assert "hooks" in adam_step.reason(opt)
    handle.remove()
    assert adam_step.reason(opt) is None
    calls = []
    handle = register_optimizer_step_post_hook(lambda *args: calls.append(args))
    try:
        adam_step._verdicts.clear()  # a new form would be probed, but for the hook
        assert "hooks" in adam_step.reason(opt)
        assert not calls, "the probe ran the user's global hook"
    finally:
        handle.remove()


def test_the_probe_refuses_a_kernel_that_differs(monkeypatch):
    """Note [Probing the one-pass Adam]: a kernel one ulp off on one element is found and
    refused, with the reason; the optimizer's own step then runs."""
    real = adam_step._kernel

    def off_by_an_ulp(params, *args):
        real(params, *args)
        p = params[-1]
        p[-1] = torch.nextafter(p[-1], torch.tensor(float("inf")))

    monkeypatch.setattr(adam_step, "_kernel", off_by_an_ulp)
    monkeypatch.setattr(adam_step, "_verdicts", {})
    why = adam_step.reason(torch.optim.AdamW([torch.randn(8)], lr=1e-3))
    assert why is not None and "differs from AdamW.step()" in why, why
    monkeypatch.setattr(adam_step, "_kernel", real)
    assert "differs" in adam_step.reason(torch.optim.AdamW([torch.randn(8)]))  # remembered
    monkeypatch.setattr(adam_step, "_verdicts", {})
    assert adam_step.reason(torch.optim.AdamW([torch.randn(8)])) is None


def test_kernel_argument_errors_name_the_argument():
    op = torch.ops.pycomm.adam_step_
    p, g, m, v, s = torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(())
    hyper = torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.01]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="must be as long"):
        op([p], [g, g], [m], [v], [s], hyper)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be a contiguous float32 CPU"):
        op([p], [g.double()], [m], [v], [s], hyper)
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] has 3 elements but params\[0\]"):
        op([p], [g], [m], [v[:3]], [s], hyper)
    with pytest.raises(RuntimeError, match=r"steps\[0\] must be a one-element"):
        op([p], [g], [m], [v], [torch.zeros(2)], hyper)
    with pytest.raises(RuntimeError, match=r"hyper must be a contiguous float64 CPU tensor"):
        op([p], [g], [m], [v], [s], hyper.float())
    assert float(s) == 0.0 and not p.any(), "a refused call changed nothing"


def test_kernel_opcheck():
    n = (1 << 15) + 5
    args = ([torch.randn(n), torch.randn(9)], [torch.randn(n), torch.randn(9)],
            [torch.zeros(n), torch.zeros(9)], [torch.zeros(n), torch.zeros(9)],
            [torch.zeros(()), torch.zeros(())],
            torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.01]] * 2, dtype=torch.float64))
    torch.library.opcheck(torch.ops.pycomm.adam_step_.default, args)


def test_portable_kernel_matches_torch_s_default_kernels_too():
    """Under ATEN_CPU_CAPABILITY=default torch runs its portable kernels (no fused
    multiply-add) and pycomm its portable build (csrc/grad/cpu_pieces.h): a child process
    so forced runs the bitwise tests; the probe agrees there too."""
    import os
    import subprocess
    import sys

    from tests.support.paths import REPO

    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           os.path.abspath(__file__), "-k", "bitwise or either_step or nonfinite"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
