"""pycomm.patch() (pycomm/patching.py): torch's names point at pycomm's while patched and
at torch's again after undo; pycomm's class stays itself; the patched clip_grad_norm_
equals torch's and hands torch what pycomm's fused clip does not take."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.parallel
import torch.nn.parallel.distributed
import torch.nn.utils
import torch.nn.utils.clip_grad

import pycomm
from pycomm.patching import TORCH_CLIP_GRAD_NORM_, TORCH_DDP
from tests.support.multirank import run_ranks

# Lightning, once another test imported it, makes every patch() here warn; the one test
# of that warning catches it all the same.
pytestmark = pytest.mark.filterwarnings("ignore:pycomm.patch")

_DDP_NAMES = (torch.nn.parallel, torch.nn.parallel.distributed)
_CLIP_NAMES = (torch.nn.utils, torch.nn.utils.clip_grad)


def _bound() -> tuple[list, list]:
    return ([m.DistributedDataParallel for m in _DDP_NAMES],
            [m.clip_grad_norm_ for m in _CLIP_NAMES])


def test_patch_swaps_names_and_undo_restores_them():
    assert _bound() == ([TORCH_DDP] * 2, [TORCH_CLIP_GRAD_NORM_] * 2)
    with pycomm.patch() as patched:
        assert isinstance(patched, pycomm.Patch)
        assert _bound() == ([pycomm.DistributedDataParallel] * 2,
                            [pycomm.patching.clip_grad_norm_] * 2)
        # pycomm's class is not redefined through the patched name, and its isinstance
        # answers hold against both torch's class and the patched name.
        assert pycomm.DistributedDataParallel.__mro__[1] is pycomm.ddp.compat.TorchDDPAttributes
        assert issubclass(pycomm.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
        assert issubclass(pycomm.DistributedDataParallel, TORCH_DDP)
        # torch._dynamo asks the class it bound for the active DDP module on every compile.
        assert torch.nn.parallel.distributed.DistributedDataParallel._get_active_ddp_module() \
            is None
        with pycomm.patch(clip_grad_norm=False):  # nested: undone in reverse order
            assert _bound()[1] == [pycomm.patching.clip_grad_norm_] * 2
        assert _bound()[0] == [pycomm.DistributedDataParallel] * 2
    assert _bound() == ([TORCH_DDP] * 2, [TORCH_CLIP_GRAD_NORM_] * 2)
    p = pycomm.patch(clip_grad_norm=False)
    assert _bound() == ([pycomm.DistributedDataParallel] * 2, [TORCH_CLIP_GRAD_NORM_] * 2)
    p.undo()
    p.undo()  # a second undo has nothing left to put back
    assert _bound() == ([TORCH_DDP] * 2, [TORCH_CLIP_GRAD_NORM_] * 2)


def _grads(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g, dtype=dtype)) for n in (7, 300, 1)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * 3
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 0.0, -1.0])
def test_patched_clip_grad_norm_matches_torch(norm_type):
    ours, theirs = _grads(), _grads()
    with pycomm.patch():
        total = torch.nn.utils.clip_grad_norm_((p for p in ours), 1.0, norm_type)
    expected = TORCH_CLIP_GRAD_NORM_(theirs, 1.0, norm_type)
    # Orders <= 0 go to torch's own clip (bit-exact); the fused norm sums in another
    # order than torch's foreach norm: a few ulp of fp32.
    tol = dict(rtol=0, atol=0) if norm_type <= 0 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(total, expected, **tol)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, **tol)


def _clip_dtensor_grads(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = [p.grad for p in _grads()]
    sharded = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [Shard(0)]))
               for g in full]
    for p, g in zip(sharded, full):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
    with pycomm.patch():
        total = torch.nn.utils.clip_grad_norm_(sharded, 1.0)
        with pytest.warns(UserWarning, match="empty generator"):
            torch.nn.utils.clip_grad_norm_((p for p in ()), 1.0)
    # The norm of the whole (not this rank's shard), as torch's clip gives it on the whole.
    whole = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
    for p, g in zip(whole, full):
        p.grad = g.clone()
    expected = TORCH_CLIP_GRAD_NORM_(whole, 1.0)
    torch.testing.assert_close(total.full_tensor(), expected)


def test_patched_clip_grad_norm_clips_dtensors_by_the_whole_norm():
    run_ranks(_clip_dtensor_grads)


def test_patch_warns_when_lightning_bound_torch_ddp_first():
    pytest.importorskip("lightning", reason="the integrations extra (lightning) is absent")
    import lightning.pytorch.strategies.ddp  # noqa: F401  (binds torch's class at import)

    with pytest.warns(UserWarning, match="before importing Lightning"):
        pycomm.patch().undo()


def test_import_pycomm_imports_no_integration_library():
    code = ("import sys, pycomm\n"
            "loaded = [m for m in ('lightning', 'pytorch_lightning', 'accelerate', "
            "'transformers') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)
