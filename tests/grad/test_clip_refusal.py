"""Every clip refuses a non-finite total norm as torch.nn.utils.clip_grad_norm_ does under
error_if_nonfinite (its message, character for character; nothing scaled) and otherwise
returns torch's norm: pycomm.clip_grad_norm_ on plain CPU gradients (the C++ walk of
.grad, and the pycomm::clip_grad_norm_ composite that strided gradients take),
pycomm.ops.clip_grad_norm_, pycomm.clip_grad_norm_ on FSDP2's DTensor gradients,
DistributedDataParallel.clip_grad_norm_ from its bucket partials and the sharded
optimizer's clip from its shards, all of which end in the one finish (See Note [One clip
finish] in csrc/grad/clip.h). The oracle is torch's clip on the same gradients, whole. The
local clip's refusal, a collective one, is tests/grad/test_local_clip.py's."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks

# Orders that C++ and Python write differently ("2" / "2.0", "1e-05", "1e+16"), and the
# orders users clip with.
WRITTEN = [2.0, 1.0, 3.0, 0.5, math.inf, 1 / 3, 1e-5, 1e16]
NORM_TYPES = [2.0, 1.0, 3.0, 0.5, math.inf]
# Far below the gradients' norms: every finite clip scales.
MAX_NORM = 1e-4


def _params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty(g.shape))
        p.grad = g.clone()
        out.append(p)
    return out


def _refusal(clip, *args, **kwargs) -> str:
    """The message of the RuntimeError `clip(*args, **kwargs)` raises."""
    with pytest.raises(RuntimeError) as raised:
        clip(*args, **kwargs)
    return str(raised.value)


def _torch_refusal(grads: list[torch.Tensor], norm_type: float) -> str:
    return _refusal(torch.nn.utils.clip_grad_norm_, _params(grads), 1.0, norm_type,
                    error_if_nonfinite=True)


def _grads(strided: bool, bad: float | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 48, generator=gen), torch.randn(70000, generator=gen),
             torch.randn(5, generator=gen)]
    if strided:  # not a dense span: the composite's path
        grads[0] = torch.randn(64, 96, generator=gen)[:, ::2]
    if bad is not None:
        grads[1][123] = bad
    return grads


_PLAIN = {
    "clip_grad_norm_": lambda ps, *args: pycomm.clip_grad_norm_(ps, *args),
    "ops.clip_grad_norm_": lambda ps, *args: pycomm.ops.clip_grad_norm_(
        [p.grad for p in ps], *args),
}


@pytest.mark.parametrize("path", list(_PLAIN))
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("norm_type", WRITTEN)
def test_plain_gradients_refuse_in_torch_s_words(path, strided, bad, norm_type):
    grads = _grads(strided, bad)
    want = _torch_refusal(grads, norm_type)
    ours = _params(grads)
    got = _refusal(_PLAIN[path], ours, 1.0, norm_type, True)
    assert got == want
    for p, g in zip(ours, grads):  # nothing scaled
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("path", list(_PLAIN))
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_plain_gradients_give_torch_s_norm(path, strided, norm_type):
    grads = _grads(strided)
    ours, ref = _params(grads), _params(grads)
    got = _PLAIN[path](ours, MAX_NORM, norm_type, True)
    want = torch.nn.utils.clip_grad_norm_(ref, MAX_NORM, norm_type, error_if_nonfinite=True)
    # torch rounds each tensor's norm to fp32 before combining them (for p = 3, a few fp32
    # ulps once cubed back), pycomm rounds once: fp32 noise, inherited by the gradients.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)


def _dtensor(rank: int, world: int) -> None:
    """FSDP2 gradients; the NaN in one rank's shard only, so the others learn of it through
    the all-reduce."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    params = list(model.parameters())
    for norm_type in (2.0, math.inf, 3.0):
        for step, bad in enumerate((None, math.nan)):
            for p in params:
                p.grad = None
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).sum() \
                .backward()
            if bad is not None and rank == world - 1:
                params[0].grad.to_local().view(-1)[0] = bad
            whole = [p.grad.full_tensor() for p in params]
            where = f"rank {rank} p={norm_type}"
            if bad is None:
                want = torch.nn.utils.clip_grad_norm_(_params(whole), MAX_NORM, norm_type)
                got = pycomm.clip_grad_norm_(params, MAX_NORM, norm_type, True)
                # float64 partials all-reduced vs fp32 norms per tensor: fp32 noise
                torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=0,
                                           msg=where)
                continue
            saved = [p.grad.to_local().clone() for p in params]
            got = _refusal(pycomm.clip_grad_norm_, params, 1.0, norm_type, True)
            assert got == _torch_refusal(whole, norm_type), where
            for p, s in zip(params, saved):
                torch.testing.assert_close(p.grad.to_local(), s, rtol=0, atol=0, equal_nan=True)


def test_dtensor_gradients_refuse_in_torch_s_words():
    run_ranks(_dtensor, world_size=2)


def _steps(rank: int, models):
    """Three synchronized backwards of each (model, what zeroes its gradients) in `models` on
    the same inputs, the last with a NaN loss on rank 1 (so every rank's averaged gradients
    are NaN); yields the step's index and whether it is the NaN one."""
    for step in range(3):
        bad = step == 2
        x = make_input("mlp", rank, step)
        for model, zeroes in models:
            zeroes.zero_grad(set_to_none=True)
            (loss_of(model(x)) * (math.nan if bad and rank == 1 else 1.0)).backward()
        yield step, bad


def _ddp(rank: int, world: int) -> None:
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)
    for norm_type in (2.0, math.inf, 3.0):
        for step, bad in _steps(rank, ((ref, ref), (ours, ours))):
            where = f"rank {rank} p={norm_type} step {step}"
            if step > 0:  # attached by the first clip: the bucket partials are the norm's
                n = len(ours.reducer.bucket_indices())
                assert n > 1 and ours._runtime.bucket_norms.complete(n, norm_type), where
            if not bad:
                want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type,
                                                      error_if_nonfinite=True)
                got = ours.clip_grad_norm_(MAX_NORM, norm_type, True)
                # summed per bucket instead of per tensor: fp32 order noise
                torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=where)
                continue
            want = _refusal(torch.nn.utils.clip_grad_norm_, ref.parameters(), 1.0, norm_type,
                            error_if_nonfinite=True)
            before = [p.grad.clone() for p in ours.parameters()]
            assert _refusal(ours.clip_grad_norm_, 1.0, norm_type, True) == want, where
            for p, g in zip(ours.parameters(), before):
                torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)


def test_ddp_clip_refuses_in_torch_s_words():
    run_ranks(_ddp, world_size=2)


def _sharded(rank: int, world: int) -> None:
    """The sharded optimizer with released gradients: the norm from each rank's partial of
    the runs it owns, all-reduced."""
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                          release_gradients=True)
    for norm_type in (2.0, math.inf, 3.0):
        for step, bad in _steps(rank, ((ref, ref), (ddp, zero))):
            where = f"rank {rank} p={norm_type} step {step}"
            assert zero.grads_in_shards and all(p.grad is None for p in ddp.parameters()), where
            if not bad:
                want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type,
                                                      error_if_nonfinite=True)
                got = zero.clip_grad_norm_(MAX_NORM, norm_type, True)
                # summed per shard run instead of per tensor: fp32 order noise
                torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=where)
                continue
            want = _refusal(torch.nn.utils.clip_grad_norm_, ref.parameters(), 1.0, norm_type,
                            error_if_nonfinite=True)
            assert _refusal(zero.clip_grad_norm_, 1.0, norm_type, True) == want, where
            assert _refusal(pycomm.clip_grad_norm_, ddp.parameters(), 1.0, norm_type,
                            True) == want, where


def test_sharded_optimizer_clip_refuses_in_torch_s_words():
    run_ranks(_sharded, world_size=2)
