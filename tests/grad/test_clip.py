"""pycomm.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ (the oracle), on CPU and,
where present, CUDA: same total norm, same clipped gradients, same errors and dtypes."""

import math
import warnings

import pytest
import torch

import pycomm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and pycomm._C.cuda else [])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NORM_TYPES = [2.0, float("inf"), 1.0, 3.0, 0.5]
SHAPES = [(64, 48), (48,), (0,), (3, 5, 7), (70000,), (1,)]


def _twin_params(shapes, dtype, device, seed=0, grad_scale=1e-2):
    """Two identical parameter lists with gradients: one for pycomm, one for torch."""
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(s, generator=gen) * grad_scale).to(device, dtype) for s in shapes]
    ours, ref = [], []
    for g in grads:
        for out in (ours, ref):
            p = torch.nn.Parameter(torch.empty(g.shape, dtype=dtype, device=device))
            p.grad = g.clone()
            out.append(p)
    return ours, ref


def _shapes_for(norm_type):
    # torch refuses the inf-norm of an empty gradient (no identity for max); pycomm lets an
    # empty gradient contribute nothing. Compare inf without it; see the test for that.
    return [s for s in SHAPES if 0 not in s] if norm_type == float("inf") else SHAPES


def _rtol(dtype):
    # torch rounds each per-tensor norm to the gradient dtype before combining them; pycomm
    # accumulates everything in fp32/fp64 and rounds once, so the totals may differ by an ulp
    # or two of the dtype (half/bfloat16), or by fp32/fp64 summation-order noise. The
    # clipped gradients inherit that through the coefficient.
    return {torch.float32: 1e-5, torch.float64: 1e-12,
            torch.float16: 2 * torch.finfo(torch.float16).eps,
            torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}[dtype]


def _assert_same(ours, ref, n_ours, n_ref, dtype):
    assert n_ours.dtype == n_ref.dtype and n_ours.device == n_ref.device and n_ours.dim() == 0
    torch.testing.assert_close(n_ours, n_ref, rtol=_rtol(dtype), atol=0, equal_nan=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=_rtol(dtype), atol=1e-12,
                                   equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["active", "inactive"])
def test_matches_torch(device, dtype, norm_type, max_norm):
    ours, ref = _twin_params(_shapes_for(norm_type), dtype, device)
    n_ours = pycomm.clip_grad_norm_(ours, max_norm, norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    _assert_same(ours, ref, n_ours, n_ref, dtype)


def test_inf_norm_of_an_empty_gradient_contributes_nothing():
    ours, ref = _twin_params([(0,), (5,)], torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="infinity norm on an empty tensor"):
        torch.nn.utils.clip_grad_norm_(ref, 1.0, float("inf"))
    assert pycomm.clip_grad_norm_(ours, 1.0, float("inf")) == ref[1].grad.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_one_huge_tensor(device):
    ours, ref = _twin_params([(1 << 23) + 3], torch.float32, device)
    exact = torch.linalg.vector_norm(ours[0].grad.double())
    n_ours = pycomm.clip_grad_norm_(ours, 0.5)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    # pycomm's chunked fp32 sums stay within fp32 noise of the exact norm ...
    torch.testing.assert_close(n_ours.double(), exact, rtol=1e-6, atol=0)
    # ... torch's single fp32 reduction over 8M elements drifts ~3e-4 here (measured on
    # torch 2.13 CPU), and the clipped gradients inherit that through the coefficient.
    torch.testing.assert_close(n_ours, n_ref, rtol=1e-3, atol=0)
    torch.testing.assert_close(ours[0].grad, ref[0].grad, rtol=1e-3, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thousands_of_tiny_tensors(device, dtype):
    ours, ref = _twin_params([(3,)] * 2000 + [(1,)] * 1000, dtype, device)
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours, 0.01),
                 torch.nn.utils.clip_grad_norm_(ref, 0.01), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_promote_like_torch(device):
    for dtypes in [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
                   (torch.float16, torch.float64)]:
        ours, ref = [], []
        for i, dt in enumerate(dtypes):
            o, r = _twin_params([(100 * (i + 1),)], dt, device, seed=i)
            ours += o
            ref += r
        n_ours = pycomm.clip_grad_norm_(ours, 0.01)
        n_ref = torch.nn.utils.clip_grad_norm_(ref, 0.01)
        assert n_ours.dtype == n_ref.dtype == torch.promote_types(*dtypes)
        _assert_same(ours, ref, n_ours, n_ref, torch.bfloat16)  # loosest dtype in the mix


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_gradients(device):
    ours, ref = _twin_params([(48, 64), (64, 48)], torch.float32, device)
    for params in (ours, ref):
        gen = torch.Generator().manual_seed(5)
        dense = torch.randn(64, 48, generator=gen).to(device).t()       # transposed, dense
        strided = torch.randn(64, 96, generator=gen).to(device)[:, ::2]  # gaps between rows
        params[0].grad, params[1].grad = dense, strided
    assert not ours[0].grad.is_contiguous() and not ours[1].grad.is_contiguous()
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours, 0.1),
                 torch.nn.utils.clip_grad_norm_(ref, 0.1), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 3.0])
def test_nonfinite_gradients_like_torch(device, bad, norm_type):
    ours, ref = _twin_params(_shapes_for(norm_type), torch.float32, device)
    for params in (ours, ref):
        params[-2].grad[123] = bad  # the (70000,) gradient
    n_ours = pycomm.clip_grad_norm_(ours, 1.0, norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
    assert math.isnan(n_ref.item()) == (bad != bad)
    _assert_same(ours, ref, n_ours, n_ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_error_if_nonfinite_raises_before_touching_grads(device):
    ours, ref = _twin_params(SHAPES, torch.float32, device)
    ours[0].grad[0, 0] = ref[0].grad[0, 0] = float("inf")
    before = [p.grad.clone() for p in ours]
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        torch.nn.utils.clip_grad_norm_(ref, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        pycomm.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    for p, b in zip(ours, before):
        assert torch.equal(p.grad, b)
    assert pycomm.clip_grad_norm_(_twin_params(SHAPES, torch.float32, device)[0], 1.0,
                                  error_if_nonfinite=True).isfinite()


def test_degenerate_inputs_like_torch():
    assert torch.equal(pycomm.clip_grad_norm_([], 1.0), torch.nn.utils.clip_grad_norm_([], 1.0))
    no_grad = [torch.nn.Parameter(torch.ones(3))]
    assert pycomm.clip_grad_norm_(no_grad, 1.0).item() == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        pycomm.clip_grad_norm_((p for p in []), 1.0)
    ours, ref = _twin_params([(10,)], torch.float32, "cpu")  # a single Tensor, not a list
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours[0], 0.01),
                 torch.nn.utils.clip_grad_norm_(ref[0], 0.01), torch.float32)
    ours, _ = _twin_params([(10,)], torch.float32, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pycomm.clip_grad_norm_((p for p in ours), 1.0)  # a non-empty generator: no warning


def test_unsupported_norm_type_is_refused_clearly():
    ours, _ = _twin_params([(10,)], torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="norm_type must be > 0 or inf, got 0"):
        pycomm.clip_grad_norm_(ours, 1.0, norm_type=0)
    with pytest.raises(RuntimeError, match="norm_type must be > 0 or inf"):
        pycomm.clip_grad_norm_(ours, 1.0, norm_type=float("-inf"))


def test_non_tensor_parameter_is_refused_clearly():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(TypeError, match=r"parameters\[1\] is a str, not a Tensor"):
        pycomm.clip_grad_norm_([p, "weight"], 1.0)



# pycomm.clip_grad_norm_ on plain CPU gradients reads them straight from the parameters;
# pycomm.ops.clip_grad_norm_ runs the composite of the fused ops (See Note [Clip straight
# from the parameters] in csrc/grad/clip_bind.cpp). Same chunks, same roundings: bit-exact.
@pytest.mark.parametrize("dtypes", [
    (torch.float32,), (torch.float64,), (torch.bfloat16,), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64)])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["active", "inactive"])
def test_parameter_path_is_bit_exact_with_the_composite(dtypes, norm_type, max_norm):
    ours, ref = [], []
    for i, shape in enumerate([(70000,), (3, 5), (1,), (1024,)] * 3):
        o, r = _twin_params([shape], dtypes[i % len(dtypes)], "cpu", seed=i)
        ours += o
        ref += r
    n_ours = pycomm.clip_grad_norm_(ours, max_norm, norm_type)
    n_ref = pycomm.ops.clip_grad_norm_([p.grad for p in ref], max_norm, norm_type)
    assert n_ours.dtype == n_ref.dtype and torch.equal(n_ours, n_ref)
    for a, b in zip(ours, ref):
        assert torch.equal(a.grad, b.grad)


def test_each_call_reads_the_current_gradients():
    # Nothing about the gradients is kept between calls: replacing, resizing in place,
    # dropping or adding a .grad is seen by the next call exactly as torch sees it.
    ours, ref = _twin_params([(1024,)] * 6, torch.float32, "cpu")
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours, 0.05),
                 torch.nn.utils.clip_grad_norm_(ref, 0.05), torch.float32)
    gen = torch.Generator().manual_seed(7)
    fresh = [torch.randn(1024, generator=gen) for _ in range(2)]
    for params in (ours, ref):
        params[0].grad = fresh[0].clone()             # replaced
        params[1].grad.resize_(0)                     # resized in place (storage kept)
        params[2].grad.resize_(8192)                  # grown in place: new storage
        params[2].grad.copy_(torch.arange(8192.0) / 8192)
        params[3].grad = None                         # dropped
        params[4].grad.mul_(1e3)                      # changed in place
    ours[1].grad, ref[1].grad = None, None  # (torch refuses an empty .grad of a 1024 param)
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours, 0.05),
                 torch.nn.utils.clip_grad_norm_(ref, 0.05), torch.float32)
    assert ours[3].grad is None
    for params in (ours, ref):
        params[3].grad = fresh[1].clone()             # added back
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours, 0.05),
                 torch.nn.utils.clip_grad_norm_(ref, 0.05), torch.float32)


def test_copy_on_write_gradients_are_not_written_through():
    # A lazily cloned gradient shares its storage copy-on-write with its source: clipping
    # must write a copy (torch's mul_ does), never the shared memory.
    ours, ref = _twin_params([(1024,), (1024,)], torch.float32, "cpu")
    sources = [p.grad.clone() for p in ours]
    before = [s.clone() for s in sources]
    for p, s in zip(ours, sources):
        p.grad = torch._lazy_clone(s)
    assert torch._C._is_cow_tensor(ours[0].grad)
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours, 0.01),
                 torch.nn.utils.clip_grad_norm_(ref, 0.01), torch.float32)
    for s, b in zip(sources, before):
        assert torch.equal(s, b)


def test_gradients_of_a_tensor_subclass_take_the_general_path():
    class Tagged(torch.Tensor):
        pass

    ours, ref = _twin_params([(64,), (32,)], torch.float32, "cpu")
    ours[0].grad = ours[0].grad.as_subclass(Tagged)
    _assert_same(ours, ref, pycomm.clip_grad_norm_(ours, 0.01),
                 torch.nn.utils.clip_grad_norm_(ref, 0.01), torch.float32)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA build")
def test_gradients_on_two_devices_like_torch():
    ours, ref = _twin_params(SHAPES, torch.float32, "cpu")
    o2, r2 = _twin_params(SHAPES, torch.float32, "cuda", seed=1)
    _assert_same(ours + o2, ref + r2, pycomm.clip_grad_norm_(ours + o2, 0.01),
                 torch.nn.utils.clip_grad_norm_(ref + r2, 0.01), torch.float32)
