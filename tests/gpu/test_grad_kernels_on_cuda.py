"""pycomm's fused CUDA gradient kernels against torch's foreach path on the same device:
the clip (norm partials, coefficient, scale: pycomm.clip_grad_norm_ against
torch.nn.utils.clip_grad_norm_(foreach=True)) and the accumulation (pycomm.ops.accumulate_
against torch._foreach_add_), on the GPT-2-small parameter set (148 tensors, 124M
elements) and 1,000 tensors of 1,024 elements, in fp32, bf16 and fp16; and the non-finite
flag, raised on the device while the host runs on (no synchronization), for any tensor
of the set. tests/grad/test_clip.py and tests/grad/test_ops.py run their CPU checks on
CUDA too where it exists; these add the sizes and the no-sync property."""

from __future__ import annotations

import pytest
import torch

from tests.support import gpu

gpu.require()

import pycomm  # noqa: E402
from pycomm.bench.clip import gpt2_small_shapes  # noqa: E402

SETS = {"gpt2-small": gpt2_small_shapes, "1000x1024": lambda: [(1024,)] * 1000}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# torch rounds each per-tensor norm to the gradient dtype before combining them; pycomm
# accumulates in fp32 and rounds once: the totals may differ by an ulp or two of a half
# dtype, or by fp32 summation-order noise (tests/grad/test_clip.py's rule).
RTOL = {torch.float32: 1e-5, torch.float16: 2 * torch.finfo(torch.float16).eps,
        torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}


def _grads(shapes, dtype, seed):
    """Random gradients of ~1e-3 per element on the device (GPT-2 small: total norm ~11)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(s, generator=gen, device="cuda") * 1e-3).to(dtype) for s in shapes]


def _params(grads):
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g
        out.append(p)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SETS))
@pytest.mark.parametrize("mode", ["active", "inactive"])
def test_clip_matches_torch_foreach(case, dtype, mode):
    grads = _grads(SETS[case](), dtype, seed=1)
    ref = _params([g.clone() for g in grads])
    ours = _params(grads)
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref], foreach=True).item()
    max_norm = 0.5 * norm if mode == "active" else 1e9
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True)
    n_ours = pycomm.clip_grad_norm_(ours, max_norm)
    assert n_ours.dtype == n_ref.dtype and n_ours.device == n_ref.device
    torch.testing.assert_close(n_ours, n_ref, rtol=RTOL[dtype], atol=0)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL[dtype], atol=1e-12,
                                   msg=lambda m, i=i: f"gradient {i}: {m}")
    if mode == "inactive":  # a coefficient of 1 touches nothing
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, ref))


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SETS))
def test_accumulate_matches_torch_foreach(case, grad_dtype):
    shapes = SETS[case]()
    grads = _grads(shapes, grad_dtype, seed=2)
    # fp32 accumulators for every gradient dtype (the main grads of a bf16/fp16 model)
    acc = [g.float() * 3 for g in _grads(shapes, grad_dtype, seed=3)]
    ref = [a.clone() for a in acc]
    exact = [a.double() + 0.25 * g.double() for a, g in zip(acc, grads)]
    pycomm.ops.accumulate_(acc, grads, 0.25)
    torch._foreach_add_(ref, grads, alpha=0.25)
    eps = torch.finfo(torch.float32).eps
    for i, (got, want, x) in enumerate(zip(acc, ref, exact)):
        # One opmath multiply-add, rounded once (twice where not fused): within an fp32
        # ulp of the exact result, and so within two of torch's.
        torch.testing.assert_close(got.double(), x, rtol=eps, atol=1e-12,
                                   msg=lambda m, i=i: f"accumulator {i} vs exact: {m}")
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=1e-12,
                                   msg=lambda m, i=i: f"accumulator {i} vs torch: {m}")


def _host_ran_ahead(fn):
    """Run `fn` behind ~0.1 s of device work on the current stream; True when it returned
    before that work ended, i.e. nothing in it waited for the device."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # cycles: ~0.1 s at ~2 GHz
    torch.cuda.set_sync_debug_mode("error")  # an ATen synchronization raises
    try:
        result = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ahead = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return ahead, result


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SETS))
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")], ids=str)
def test_nonfinite_flag_is_set_on_the_device_without_a_host_sync(case, dtype, bad):
    grads = _grads(SETS[case](), dtype, seed=4)
    where = len(grads) // 2
    if bad is not None:  # one element in the middle of one tensor
        flat = grads[where].view(-1)
        flat[flat.numel() // 2] = bad

    def clip_steps():
        partial = pycomm.ops.norm_partial(grads, 2.0)
        total, coef = pycomm.ops.clip_coef(partial, 2.0, 1.0, dtype)
        pycomm.ops.scale_(grads, coef)
        return partial, total

    ahead, (partial, total) = _host_ran_ahead(clip_steps)
    assert ahead, "norm_partial / clip_coef / scale_ waited for the device"
    assert partial[1].item() == (0 if bad is None else 1)
    assert torch.isfinite(total).item() == (bad is None)
    # The user-facing clip, error_if_nonfinite=False as torch's default: no sync either.
    params = _params(_grads(SETS[case](), dtype, seed=5))
    ahead, total = _host_ran_ahead(lambda: pycomm.clip_grad_norm_(params, 1.0))
    assert ahead, "pycomm.clip_grad_norm_ waited for the device"
    assert torch.isfinite(total).item()


def test_error_if_nonfinite_raises_and_leaves_the_gradients():
    grads = _grads([(1024,)] * 10, torch.float32, seed=6)
    grads[3][7] = float("inf")
    params = _params(grads)
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        pycomm.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
