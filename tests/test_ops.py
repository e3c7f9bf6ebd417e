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
    got = pycomm.sum_squares(x)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.device == x.device and got.dim() == 0
    torch.testing.assert_close(got.double().cpu(), _reference_sum_squares(x).cpu(),
                               rtol=_RTOL[dtype], atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sum_squares_rejects_bad_input(device):
    with pytest.raises(RuntimeError, match="must be contiguous"):
        pycomm.sum_squares(torch.randn(8, 8, device=device).t())
    with pytest.raises(RuntimeError, match="must be a floating-point tensor"):
        pycomm.sum_squares(torch.ones(4, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_squares_opcheck(device, dtype):
    x = torch.randn(1000, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.pycomm.sum_squares.default, (x,))
