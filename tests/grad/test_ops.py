"""pycomm's ops against plain torch, on CPU and (where present) CUDA, plus opcheck."""

import pytest
import torch

import pycomm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and pycomm._C.cuda else [])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _reference_sum_squares(x):
    return x.double().square().sum()


# Tolerances: the kernel accumulates in opmath (fp32 for half/bf16, fp64 for double) with a
# chunked tree order; the reference is exact in fp64. Relative error grows like eps * log(n).
_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-5, torch.bfloat16: 1e-5}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 7, 4096, 1 << 16, (1 << 20) + 3])
def test_sum_squares_matches_torch(device, dtype, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(device, dtype)
    got = pycomm.ops.sum_squares(x)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.device == x.device and got.dim() == 0
    torch.testing.assert_close(got.double().cpu(), _reference_sum_squares(x).cpu(),
                               rtol=_RTOL[dtype], atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sum_squares_rejects_bad_input(device):
    with pytest.raises(RuntimeError, match="must be contiguous"):
        pycomm.ops.sum_squares(torch.randn(8, 8, device=device).t())
    with pytest.raises(RuntimeError, match="must be a floating-point tensor"):
        pycomm.ops.sum_squares(torch.ones(4, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_squares_opcheck(device, dtype):
    x = torch.randn(1000, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.pycomm.sum_squares.default, (x,))


# --- fused clipping / accumulation ops (norm_partial, clip_coef, scale_, accumulate_) ---

NORM_TYPES = [1.0, 2.0, 3.0, 0.5, float("inf")]
# Lists that exercise the chunking: an empty tensor, pieces straddling the 65,536-element CPU
# chunk and CUDA chunk boundaries, odd tails shorter than one vector, many tiny tensors.
LIST_SIZES = {
    "mixed": [0, 1, 7, 65535, 65537, 3, 2 * 65536 + 5],
    "tiny": [5] * 1500,
}


def _randn_list(sizes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(device, dtype) for n in sizes]


def _reference_partial(tensors, p):
    x = torch.cat([t.double().flatten().cpu() for t in tensors])
    if p == float("inf"):
        return x.abs().max() if x.numel() else torch.tensor(0.0, dtype=torch.float64)
    return x.abs().pow(p).sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("sizes", list(LIST_SIZES), ids=str)
def test_norm_partial_matches_torch(device, dtype, norm_type, sizes):
    ts = _randn_list(LIST_SIZES[sizes], dtype, device)
    got = pycomm.ops.norm_partial(ts, norm_type)
    assert got.shape == (2,) and got.device == ts[0].device
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # Exact for inf (a max); else opmath accumulation (fp32 for all but fp64) in chunked order
    # vs an exact fp64 sum of the same rounded inputs: relative error ~ eps(opmath) * log(n).
    rtol = 0 if norm_type == float("inf") else (1e-12 if dtype == torch.float64 else 2e-5)
    torch.testing.assert_close(got[0].double().cpu(), _reference_partial(ts, norm_type),
                               rtol=rtol, atol=0)
    assert got[1].item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_norm_partial_flags_nonfinite(device, dtype, bad):
    ts = _randn_list([100, 70000], dtype, device)
    ts[1][69999] = bad  # the very last element: the scalar tail must see it too
    for p in NORM_TYPES:
        acc, flag = pycomm.ops.norm_partial(ts, p).tolist()
        assert flag == 1
        assert (acc != acc) if bad != bad else acc == float("inf")


@pytest.mark.parametrize("device", DEVICES)
def test_norm_partial_overflow_is_not_nonfinite(device):
    # Squares overflow fp32 (torch's norm is inf too), but no element is inf or nan.
    acc, flag = pycomm.ops.norm_partial([torch.full((64,), 1e30, device=device)]).tolist()
    assert acc == float("inf") and flag == 0


@pytest.mark.parametrize("device", DEVICES)
def test_norm_partial_mixed_dtypes_and_layouts(device):
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(3)).to(device)
    ts = [base.t(),                       # dense, not contiguous: read in place
          base[:, ::3],                   # strided: read through a copy
          base[:5].to(torch.bfloat16),
          base[5:9].to(torch.float16)]
    for p in NORM_TYPES:
        got = pycomm.ops.norm_partial(ts, p)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got[0].double().cpu(), _reference_partial(ts, p),
                                   rtol=2e-5, atol=0)  # fp32 accumulation, as above
    assert pycomm.ops.norm_partial([base, base.double()]).dtype == torch.float64


@pytest.mark.parametrize("device", DEVICES)
def test_list_ops_reject_bad_input(device):
    x = torch.randn(8, device=device)
    with pytest.raises(RuntimeError, match="norm_type must be > 0 or inf"):
        pycomm.ops.norm_partial([x], 0.0)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] must be a floating-point tensor"):
        pycomm.ops.norm_partial([x, torch.ones(3, dtype=torch.int64, device=device)])
    with pytest.raises(RuntimeError, match="factor must be a one-element floating tensor"):
        pycomm.ops.scale_([x], torch.ones(2, device=device))
    with pytest.raises(RuntimeError, match=r"acc\[0\] is Half and grads\[0\] is BFloat16"):
        pycomm.ops.accumulate_([x.half()], [x.bfloat16()])
    with pytest.raises(RuntimeError, match=r"acc\[0\] has 8 elements but grads\[0\] has 4"):
        pycomm.ops.accumulate_([x], [x[:4]])
    with pytest.raises(RuntimeError, match="partial must be a contiguous float32/float64"):
        pycomm.ops.clip_coef(torch.ones(3, device=device), 2.0, 1.0, torch.float32)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and the CUDA build")
def test_list_ops_reject_mixed_devices():
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is on cpu but tensors\[0\] is on cuda"):
        pycomm.ops.norm_partial([torch.ones(3, device="cuda"), torch.ones(3)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_coef_matches_torch_arithmetic(device, dtype, norm_type):
    ts = _randn_list([1000, 17], dtype, device)
    partial = pycomm.ops.norm_partial(ts, norm_type)
    for max_norm in (1e-3, 1.0, 1e9):
        total, coef = pycomm.ops.clip_coef(partial, norm_type, max_norm, dtype)
        assert total.dtype == dtype and coef.dtype == (
            torch.float64 if dtype == torch.float64 else torch.float32)
        # The same finished norm through torch's own tensor arithmetic in `dtype`: bit-exact
        # for p in (1, 2, inf); pow(acc, 1/p) may differ by an ulp between libm and torch.
        acc = partial[0].to(torch.float64 if dtype == torch.float64 else torch.float32)
        if norm_type == 2.0:
            want_total = acc.sqrt().to(dtype)
        elif norm_type in (1.0, float("inf")):
            want_total = acc.to(dtype)
        else:
            want_total = acc.pow(1 / norm_type).to(dtype)
        exact = norm_type in (1.0, 2.0, float("inf"))
        torch.testing.assert_close(total, want_total, atol=0,
                                   rtol=0 if exact else torch.finfo(dtype).eps)
        # The coefficient from that total, bit-exact: torch's rounding steps in `dtype`.
        assert torch.equal(coef.to(dtype), torch.clamp(max_norm / (total + 1e-6), max=1.0))


def _snan_tensor(n, device):
    # Signalling-NaN bits: any arithmetic (even * 1.0) quietens them, so unchanged bits prove
    # that scale_ touched nothing.
    return torch.full((n,), 0x7F800001, dtype=torch.int32, device=device).view(torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.float64])
def test_scale_by_one_touches_nothing(device, factor_dtype):
    xs = [_snan_tensor(n, device) for n in (3, 70000)]
    pycomm.ops.scale_(xs, torch.ones((), dtype=factor_dtype, device=device))
    assert all((x.view(torch.int32) == 0x7F800001).all() for x in xs)
    pycomm.ops.scale_(xs, torch.full((), 0.5, dtype=factor_dtype, device=device))
    assert not any((x.view(torch.int32) == 0x7F800001).any() for x in xs)  # control


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", list(LIST_SIZES), ids=str)
def test_scale_matches_torch(device, dtype, sizes):
    xs = _randn_list(LIST_SIZES[sizes], dtype, device)
    factor = torch.tensor(0.3, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                          device=device)
    want = [x * factor.to(x.dtype) if x.dtype == torch.float64 else
            (x.float() * factor).to(x.dtype) for x in xs]
    pycomm.ops.scale_(xs, factor)
    for got, ref in zip(xs, want):
        assert torch.equal(got, ref)  # one rounding of the same opmath product: bit-exact


@pytest.mark.parametrize("device", DEVICES)
def test_scale_handles_any_layout(device):
    # Dense non-contiguous (in place); strided (torch's mul_ fallback). Separate storages.
    views = [torch.randn(64, 48, device=device).t(), torch.randn(64, 48, device=device)[:, ::3]]
    want = [v * 0.5 for v in views]
    pycomm.ops.scale_(views, torch.tensor(0.5, device=device))
    for got, ref in zip(views, want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("acc_dtype,grad_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float32, torch.float32), (torch.float64, torch.float64),
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_accumulate_matches_torch(device, acc_dtype, grad_dtype):
    sizes = LIST_SIZES["mixed"]
    acc = _randn_list(sizes, acc_dtype, device, seed=1)
    grads = _randn_list(sizes, grad_dtype, device, seed=2)
    want = [(a.double() + 0.25 * g.double()) for a, g in zip(acc, grads)]
    pycomm.ops.accumulate_(acc, grads, 0.25)
    for got, ref in zip(acc, want):
        # One opmath multiply-add, rounded once to acc's dtype (twice where it is not fused):
        # within one ulp of acc's dtype of the exact result.
        torch.testing.assert_close(got.double(), ref, rtol=torch.finfo(acc_dtype).eps,
                                   atol=torch.finfo(acc_dtype).eps)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_handles_mismatched_layouts(device):
    acc = torch.zeros(48, 64, device=device).t()  # dense but strides differ from grad's
    grad = torch.randn(64, 48, device=device, dtype=torch.bfloat16)
    pycomm.ops.accumulate_([acc], [grad], 2.0)
    assert torch.equal(acc, grad.float() * 2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_list_ops_opcheck(device, dtype):
    ts = _randn_list([300, 5, 0], dtype, device)
    for p in (2.0, float("inf"), 3.0):
        torch.library.opcheck(torch.ops.pycomm.norm_partial.default, (ts, p))
    partial = pycomm.ops.norm_partial(ts)
    torch.library.opcheck(torch.ops.pycomm.clip_coef.default, (partial, 2.0, 0.5, dtype))
    factor = torch.tensor(0.5, device=device)
    torch.library.opcheck(torch.ops.pycomm.scale_.default, (ts, factor))
    acc = _randn_list([300, 5, 0], torch.float32 if dtype != torch.float64 else dtype, device)
    torch.library.opcheck(torch.ops.pycomm.accumulate_.default, (acc, ts, 0.5))
    torch.library.opcheck(torch.ops.pycomm.clip_grad_norm_.default, (ts, 0.5, 2.0, False))


def test_cpu_kernels_follow_aten_capability():
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    assert pycomm._C._cpu_kernels() == ("avx2" if avx2 else "default")


def test_portable_cpu_kernels_match_torch_too():
    # The CPU loops exist twice (ATen's portable at::vec and its AVX2 build, picked by
    # ATen's CPU capability); this process runs one, a child forced to ATen's default
    # capability runs the other through the same checks.
    import os
    import subprocess
    import sys

    from tests.support.paths import REPO

    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(
        __file__), "-k", "cpu and (norm_partial_matches or scale_matches or "
        "accumulate_matches or touches_nothing or flags_nonfinite or follow_aten) and not portable"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
