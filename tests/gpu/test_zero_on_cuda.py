"""pycomm.ZeroRedundancyOptimizer on a CUDA module: the sharded step, the released buckets
(freed after record_stream), the reduce-scatter on NCCL and the all-gathers behind the
forward have run nowhere else. On the same two groups as test_ddp_on_cuda.py (NCCL with
one rank; two Gloo ranks sharing the device), each case trains side by side with pycomm's
DDP + the same optimizer unsharded and torch's DDP + it, and compares every parameter.

Bitwise holds where it holds on CPU (tests/zero/test_zero_parity.py): the reduced
gradients are the same bits (one addition of equally scaled halves), and the optimizer's
elementwise kernels give each element the same bits whether it steps a whole parameter or
a flat range of a bucket."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.support import gpu

gpu.require()

import pycomm  # noqa: E402
from tests.gpu.test_ddp_on_cuda import GROUPS, _on_the_gpu, _run_on  # noqa: E402
from tests.support.ddp_models import build, loss_of, make_input  # noqa: E402
from tests.zero import test_zero_grad_scaler as zero_scaler  # noqa: E402
from tests.zero import test_zero_parity as zero_parity  # noqa: E402
from tests.zero.test_zero_parity import _clip_as_torch, _groups, _steps  # noqa: E402

CAP = 5e-4  # MB: the MLP in several buckets


def _ddp(base, **options):
    return pycomm.DistributedDataParallel(
        copy.deepcopy(base), device_ids=[0],
        config=pycomm.DDPConfig(bucket_cap_mb=CAP, **options))


def _differs(p, q) -> str:
    return f"{(p.float() - q.float()).abs().max().item():.3g}"


def _parity(rank, world_size, **options):
    """AdamW on two parameter groups with no_sync accumulation, 12 steps: sharded, pycomm's
    DDP + AdamW and torch's DDP + AdamW, bitwise."""
    _on_the_gpu()
    base = build("mlp").cuda()
    sharded = _ddp(base)
    zero = pycomm.ZeroRedundancyOptimizer(_groups(sharded), torch.optim.AdamW, lr=1e-2,
                                          **options)
    plain = _ddp(base)
    adamw = torch.optim.AdamW(_groups(plain), lr=1e-2, **options)
    ref = TorchDDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=CAP)
    ref_adamw = torch.optim.AdamW(_groups(ref), lr=1e-2, **options)
    for ddp, opt in ((sharded, zero), (plain, adamw), (ref, ref_adamw)):
        _steps(ddp, opt, rank, "mlp", accumulate=True)
    zero.wait_for_params()
    assert len(sharded.reducer.bucket_indices()) > 1, "the test needs several buckets"
    for (name, p), q, t in zip(sharded.module.named_parameters(), plain.module.parameters(),
                               ref.module.parameters()):
        assert p.is_cuda
        assert torch.equal(p, q), f"rank {rank} {options}: {name} vs pycomm DDP {_differs(p, q)}"
        assert torch.equal(p, t), f"rank {rank} {options}: {name} vs torch DDP {_differs(p, t)}"


def _released_and_clipped(rank, world_size):
    """After a synchronized backward no param.grad is left and every bucket's storage is
    freed (on the device, once the stream is done with it); the rank keeps 1/world of the
    gradients; the DDP clip takes torch's global norm from the shards. On one rank
    (NCCL's group here) nothing is sharded: no hook, param.grad kept (Note [One rank:
    nothing to shard] in pycomm/zero/optimizer.py)."""
    _on_the_gpu()
    base = build("wide").cuda()
    ddp = _ddp(base)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                          release_gradients=True)
    ref = TorchDDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=CAP)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    whole = sum(p.numel() for p in base.parameters())
    buckets = len(ddp.reducer.bucket_indices())
    for step in range(4):  # the buckets are re-cut after step 0
        for m, opt in ((ddp, zero), (ref, ref_opt)):
            opt.zero_grad()
            loss_of(m(make_input("mlp", rank, step))).backward()
        if world_size == 1:
            assert ddp._sync.comm_hook is None and not zero._hook_state.grads
            # The DDP clip's norm on the device is torch's to rounding (Note [Clipping from
            # partials] in pycomm/clip.py), so from step 1 the parameters, and with them
            # the gradients, may differ from torch's in their last bits.
            for p, q in zip(ddp.parameters(), ref.parameters()):
                if step == 0:
                    assert torch.equal(p.grad, q.grad), f"step 0: {_differs(p.grad, q.grad)}"
                else:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        else:
            assert all(p.grad is None for p in ddp.parameters()), f"step {step}: a grad is kept"
            assert all(ddp.reducer.grad_view(i).untyped_storage().nbytes() == 0
                       for i in range(len(ddp._named_params))), f"step {step}: a bucket is kept"
        # from step 1 on (the first keeps whole gradients: Note [The first step's buckets])
        if step > 0 and world_size > 1:
            kept = sum(t.numel() for t in zero._hook_state.grads.values())
            assert whole / world_size <= kept <= whole / world_size + world_size * buckets
        _clip_as_torch(ddp, ref)
        zero.step()
        ref_opt.step()
    zero.wait_for_params()
    for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _bf16_main_params(rank, world_size):
    _on_the_gpu()
    for release in (True, False):
        zero_parity._bf16_main_params(rank, world_size, device="cuda", release=release)


def _scaled(rank, world_size):
    _on_the_gpu()
    zero_scaler._scaled(rank, world_size, device="cuda")


def _parity_cases(rank, world_size):
    _parity(rank, world_size)  # foreach, the CUDA default
    _parity(rank, world_size, foreach=False)
    # torch's fused multi-tensor kernel on the flat pieces: each element's update reads that
    # element alone, so the pieces step to the bits the whole parameters get
    _parity(rank, world_size, fused=True)


@pytest.mark.parametrize("group", list(GROUPS))
def test_sharded_adamw_on_cuda_matches_pycomm_and_torch_ddp_bitwise(group):
    _run_on(group, _parity_cases)


@pytest.mark.parametrize("group", list(GROUPS))
def test_gradients_released_and_clipped_on_cuda(group):
    _run_on(group, _released_and_clipped)


@pytest.mark.parametrize("group", list(GROUPS))
def test_bf16_parameters_with_fp32_main_parameters_on_cuda(group):
    _run_on(group, _bf16_main_params)


@pytest.mark.parametrize("group", list(GROUPS))
def test_sharded_grad_scaler_on_cuda(group):
    """pycomm.ShardedGradScaler with CUDA gradients and a CUDA scaler (the found-inf flag
    all-reduced on the device: NCCL, and Gloo's CUDA all-reduce)."""
    _run_on(group, _scaled)
