"""pycomm's DDP on a CUDA device against torch's DDP (the oracle), bitwise: the reducer's
CUDA side (its streams, events and record_stream calls, the bucket copies on the device)
has run nowhere else. Two groups: NCCL with world size 1 (the NCCL path), and two Gloo
ranks sharing the one device, whose buckets are reduced while the other rank's backward
runs on the same GPU. Each case trains several SGD steps side by side and compares every
gradient and parameter after every step (tests/support/ddp_models.py's lockstep), over
no_sync, find_unused_parameters, static_graph, gradient_as_bucket_view, bf16 parameters
with fp32 main grads (DDPConfig.grad_reduce_dtype) and clipping during backward (the DDP
clip from per-bucket norms, and the local clip before the all-reduce).

Bitwise holds where it holds on CPU: with 1 or 2 ranks every reduced element is one
commutative fp32 addition of equally scaled halves, and torch's deterministic algorithms
make the two models' own backward kernels identical (cuDNN's and the embedding's
backward otherwise add in a varying order)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.support import gpu

gpu.require()

import pycomm  # noqa: E402
from tests.ddp import test_main_grad as main_grad  # noqa: E402
from tests.grad import test_ddp_clip as ddp_clip  # noqa: E402
from tests.grad import test_local_clip as local_clip  # noqa: E402
from tests.support.ddp_models import assert_same, build, lockstep, loss_of, make_input  # noqa: E402
from tests.support.multirank import run_ranks  # noqa: E402

TINY, ONE = 1e-6, 1000.0  # bucket caps: one parameter per bucket, one bucket
GROUPS = {"nccl-world1": (1, "nccl"), "gloo-2ranks-1gpu": (2, "gloo")}


def _run_on(group: str, fn) -> None:
    world, backend = GROUPS[group]
    run_ranks(fn, world, backend, deadline_s=600)


def _on_the_gpu() -> None:
    """Every rank on device 0, with torch's deterministic kernels (see the docstring)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without one says so
    torch.backends.cudnn.benchmark = False


def _reducer_cases(rank, world_size):
    _on_the_gpu()
    for as_view in (False, True):
        lockstep(rank, "mlp", device="cuda", gradient_as_bucket_view=as_view)
        lockstep(rank, "convbn", device="cuda", bucket_cap_mb=TINY,
                 gradient_as_bucket_view=as_view)
        # 1 MiB weights, two no_sync micro-steps: the local accumulation on the device
        lockstep(rank, "wide", device="cuda", bucket_cap_mb=TINY, no_sync_every=2,
                 gradient_as_bucket_view=as_view)
        lockstep(rank, "rankdep", device="cuda", bucket_cap_mb=TINY,
                 find_unused_parameters=True, gradient_as_bucket_view=as_view)
        lockstep(rank, "mlp", device="cuda", static_graph=True, steps=4,
                 gradient_as_bucket_view=as_view)
    lockstep(rank, "attn", device="cuda", bucket_cap_mb=ONE)
    lockstep(rank, "tied", device="cuda")


@pytest.mark.parametrize("group", list(GROUPS))
def test_reducer_on_cuda_matches_torch_ddp_bitwise(group):
    _run_on(group, _reducer_cases)


def _default_config(rank, world_size):
    """No pycomm option set: a CUDA module's gradients stay on the group it was given (the
    shared-memory backend reduces host memory only) and train as torch's DDP."""
    _on_the_gpu()
    base = build("mlp").cuda()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[0])
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), device_ids=[0])
    assert ours.gradient_group is dist.group.WORLD
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    for step in range(3):
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            loss_of(ddp(make_input("mlp", rank, step))).backward()  # moved by device_ids
        assert_same(ref, ours, f"step {step}", exact=True)
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("group", list(GROUPS))
def test_default_config_with_device_ids_matches_torch_ddp(group):
    _run_on(group, _default_config)


def _main_grads(rank, world_size):
    _on_the_gpu()
    for dtype in (torch.bfloat16, torch.float16):
        main_grad._check(rank, world_size, dtype, main_grad_only=False, exact=True,
                         device="cuda")
    main_grad._check(rank, world_size, torch.bfloat16, main_grad_only=True, exact=True,
                     device="cuda")


@pytest.mark.parametrize("group", list(GROUPS))
def test_bf16_fp16_parameters_accumulate_fp32_main_grads_on_cuda(group):
    _run_on(group, _main_grads)


def _clipping(rank, world_size):
    _on_the_gpu()
    # The DDP clip: per-bucket norm partials computed as buckets finish during backward.
    ddp_clip._lockstep_clip(rank, device="cuda")
    ddp_clip._lockstep_clip(rank, device="cuda", norm_type=float("inf"), bucket_cap_mb=1e-6)
    ddp_clip._lockstep_clip(rank, device="cuda", no_sync_every=2, bucket_cap_mb=1e-6)
    ddp_clip._lockstep_clip(rank, device="cuda", hook="fp16_compress_hook")
    # The local clip: each rank's gradients clipped before its first bucket launches.
    local_clip._lockstep(rank, world_size, device="cuda")
    local_clip._lockstep(rank, world_size, no_sync_every=2, device="cuda")
    local_clip._lockstep(rank, world_size, hook="allreduce_hook", device="cuda")


@pytest.mark.parametrize("group", list(GROUPS))
def test_clipping_during_backward_on_cuda_matches_torch(group):
    _run_on(group, _clipping)


def _one_rank_in_place(rank, world_size):
    """Note [One rank reduces nothing] on a one-GPU NCCL group: every bucket reduced where
    its gradients are (the step report says so), param.grad the tensor autograd made, with
    torch's DDP's bits, in fp32 and in bf16; the DDP clip from bucket norms still clips."""
    _on_the_gpu()
    for model, cap, dtype in (("mlp", TINY, torch.float32), ("mlp", ONE, torch.float32),
                              ("attn", ONE, torch.float32), ("mlp", ONE, torch.bfloat16)):
        base = build(model).cuda().to(dtype)
        ours = pycomm.DistributedDataParallel(copy.deepcopy(base), device_ids=[0],
                                              config=pycomm.DDPConfig(bucket_cap_mb=cap))
        ref = TorchDDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=cap)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
        what = f"{model} cap={cap} {dtype}"
        for step in range(3):
            made = {}
            hooks = [p.register_post_accumulate_grad_hook(
                lambda q, made=made: made.__setitem__(id(q), q.grad)) for p in ours.parameters()]
            x = make_input(model, rank, step).cuda()
            for m, opt in zip((ours, ref), opts):
                opt.zero_grad()
                loss_of(m(x if x.dtype == torch.long else x.to(dtype))).backward()
            for h in hooks:
                h.remove()
            buckets = ours.timelines(1)[0]["buckets"]
            assert buckets and all(b["in_place"] for b in buckets), f"{what}: {buckets}"
            for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
                assert p.grad is made[id(p)], f"{what}: {name}'s gradient was replaced"
                assert torch.equal(p.grad, q.grad), f"{what} step {step}: {name}"
            if step == 2:  # last: a clip's rounding differs from torch's in the last bit
                ours.clip_grad_norm_(1e-3)
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
            for opt in opts:
                opt.step()
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
            torch.testing.assert_close(p, q, rtol=tol, atol=1e-7,
                                       msg=lambda m, n=f"{what} {name}": f"{n}: {m}")


def test_one_rank_reduces_in_place_on_cuda():
    _run_on("nccl-world1", _one_rank_in_place)
