"""The CUDA clip's tile plans (Note [Tile plans] in csrc/grad/clip_cuda.cu): a plan is made
once per list of gradients and reused, a new list (new tensors, other sizes) gets its own,
the clip replays inside a CUDA graph (gradients made before the capture and during it), a
list of mixed dtypes and misaligned views is one call, and the result is the same bits on
every run. The values are checked against torch.nn.utils.clip_grad_norm_ on the same
gradients."""

from __future__ import annotations

import pytest
import torch

from tests.support import gpu

gpu.require()

import pycomm  # noqa: E402
from pycomm import _C  # noqa: E402
from tests.gpu.test_grad_kernels_on_cuda import _params  # noqa: E402


def _grads(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(s, generator=gen, device="cuda") * 1e-2).to(dtype) for s in shapes]


def _against_torch(grads, max_norm, rtol=1e-5):
    ref = _params([g.clone() for g in grads])
    ours = _params(grads)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True)
    n_ours = pycomm.clip_grad_norm_(ours, max_norm)
    assert n_ours.dtype == n_ref.dtype and n_ours.device == n_ref.device
    torch.testing.assert_close(n_ours, n_ref, rtol=rtol, atol=0)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=1e-12,
                                   msg=lambda m, i=i: f"[{i}] {m}")
    return n_ours


def test_a_plan_is_made_once_and_reused():
    _C._clear_tile_plans()
    before = _C._tile_plans()[0]
    grads = _grads([(1024,)] * 300 + [(70000,)])  # several tiles in the last tensor
    params = _params(grads)
    for _ in range(5):
        pycomm.clip_grad_norm_(params, 0.5)
    assert _C._tile_plans()[0] == before + 1, "five clips of one list made one plan"
    fresh = _grads([(1024,)] * 300 + [(70000,)], seed=1)  # new tensors: a new plan, new values
    _against_torch(fresh, 0.5)
    assert _C._tile_plans()[0] == before + 2


def test_the_same_bits_on_every_run():
    grads = _grads([(50257, 768), (3000,), (17,)])
    totals = []
    for _ in range(3):
        params = _params([g.clone() for g in grads])
        totals.append(pycomm.clip_grad_norm_(params, float("inf")))  # inf: nothing scaled
    assert all(torch.equal(t, totals[0]) for t in totals)
    partial = torch.ops.pycomm.norm_partial(grads, 2.0)
    assert torch.equal(partial, torch.ops.pycomm.norm_partial(grads, 2.0))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0], ids=str)
def test_mixed_dtypes_and_misaligned_views_in_one_list(norm_type):
    base = _grads([(40001,)], torch.float32)[0]
    grads = [base[1:20001],  # a view one element in: no 16-byte loads
             *_grads([(70000,), (33,)], torch.bfloat16, seed=2),
             *_grads([(5000,)], torch.float64, seed=3),
             *_grads([(1,), (65536,)], torch.float16, seed=4)]
    # the reference: the same clip in float64 (a copy: .double() of a float64 tensor is itself)
    exact = [g.to(torch.float64, copy=True) for g in grads]
    if norm_type == float("inf"):
        norm = max(e.abs().max() for e in exact)
    else:
        norm = sum((e.abs() ** norm_type).sum() for e in exact) ** (1.0 / norm_type)
    coef = torch.clamp(0.1 / (norm + 1e-6), max=1.0)
    total = pycomm.clip_grad_norm_(_params(grads), 0.1, norm_type=norm_type)
    assert total.dtype == torch.float64  # the promotion of the gradients' dtypes, as torch
    torch.testing.assert_close(total, norm, rtol=1e-6, atol=0)
    for i, (g, e) in enumerate(zip(grads, exact)):
        info = torch.finfo(g.dtype)  # the coefficient's and the product's roundings
        torch.testing.assert_close(g.double(), e * coef, rtol=2 * info.eps,
                                   atol=info.smallest_normal * info.eps,
                                   msg=lambda m, i=i, d=g.dtype: f"[{i}] {d}: {m}")
    assert torch.equal(base[20001:], _grads([(40001,)], torch.float32)[0][20001:]), \
        "the clip wrote outside the view"


@pytest.mark.parametrize("case", ["1000x1024", "gpt2-layer"])
def test_inactive_clip_touches_nothing(case):
    shapes = [(1024,)] * 1000 if case == "1000x1024" else [(768, 3072), (3072,), (768,)]
    grads = _grads(shapes)
    copies = [g.clone() for g in grads]
    pycomm.clip_grad_norm_(_params(grads), 1e9)
    assert all(torch.equal(g, c) for g, c in zip(grads, copies))


def test_small_tensors_against_torch():
    _against_torch(_grads([(1024,)] * 1000), 0.3)


def test_the_clip_replays_in_a_cuda_graph():
    """Warm-up, capture, replay: gradients made before the capture (the plan exists), and a
    training step whose backward runs in the graph (its gradients are made during capture:
    the plan is made and filled by captured launches). Each replay clips as torch would."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 8)).cuda()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(32, 64, device="cuda")
    totals = {}

    def step(m, clip, key):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        totals[key] = clip(m.parameters(), 1e-3)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(2):
            step(model, pycomm.clip_grad_norm_, "ours")
    torch.cuda.current_stream().wait_stream(side)
    pinned_before = _C._tile_plans()[1]
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step(model, pycomm.clip_grad_norm_, "ours")
    assert _C._tile_plans()[1] > pinned_before, "the captured clip pinned its plan"
    _C._clear_tile_plans()  # evicts every plan but the pinned ones
    for _ in range(3):
        x.copy_(torch.randn(32, 64, device="cuda"))
        graph.replay()
        step(ref, lambda ps, m: torch.nn.utils.clip_grad_norm_(ps, m, foreach=True), "ref")
        torch.cuda.synchronize()
        torch.testing.assert_close(totals["ours"], totals["ref"], rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-12)
    # the same gradients clipped outside the graph: the plan a graph filled is filled again
    grads = [p.grad.clone() for p in model.parameters()]
    total = pycomm.clip_grad_norm_(model.parameters(), 1e-4)
    expected = torch.nn.utils.clip_grad_norm_(_params(grads), 1e-4, foreach=True)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-12)


def test_gradients_made_before_a_capture():
    grads = _grads([(4096,)] * 50)
    params = _params(grads)
    pycomm.clip_grad_norm_(params, 1e9)  # the plan, made outside the graph
    expected_grads = [g.clone() for g in grads]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = pycomm.clip_grad_norm_(params, 0.5)
    for _ in range(2):
        graph.replay()
        expected = torch.nn.utils.clip_grad_norm_(_params(expected_grads), 0.5, foreach=True)
        torch.cuda.synchronize()
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-12)
