"""Bucket memory (See Note [Bucket memory] in csrc/reducer/bucket.cpp): torch 2.15's
lazy_bucket_allocation on pycomm's DDP. A bucket that goes through its buffer has the
buffer's bytes while its step runs and none once the step is finalized, and the gradients,
parameters and optimizer state are torch's, bit for bit (torch's DDP with the same flag where
torch has it). The argument exists exactly where torch's DDP takes it; DDPConfig's field works
on any torch. What the memory comes to is benchmarks/results/ddp_bucket_memory_cpu.md's."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.multirank import run_ranks

DDP = pycomm.DistributedDataParallel
TORCH_HAS_LAZY = "lazy_bucket_allocation" in inspect.signature(TorchDDP.__init__).parameters


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _step(ddp, opt, rank: int, step: int) -> None:
    opt.zero_grad()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
    ddp(x).square().mean().backward()


def _lazy(rank, world_size, config_kwargs, torch_lazy):
    ref = TorchDDP(_model(), bucket_cap_mb=0.001,
                   **({"lazy_bucket_allocation": True} if torch_lazy else {}))
    ours = DDP(_model(), config=pycomm.DDPConfig(bucket_cap_mb=0.001, lazy_bucket_allocation=True,
                                                 **config_kwargs))
    buffers = {}  # each bucket's buffer as its collective starts (a callback reading it)
    ours.reducer.add_pre_launch(lambda i, buf: buffers.__setitem__(
        i, (buf, buf.untyped_storage().nbytes())))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    nbuckets = len(ours.reducer.bucket_indices())
    assert nbuckets > 1
    for step in range(4):
        for ddp, opt in zip((ref, ours), opts):
            _step(ddp, opt, rank, step)
        for (name, x), y in zip(ref.module.named_parameters(), ours.module.parameters()):
            assert torch.equal(x.grad, y.grad), f"{config_kwargs} step {step}: grad of {name}"
        assert sorted(buffers) == list(range(nbuckets))
        for i, (buf, held) in buffers.items():
            assert held == buf.numel() * buf.element_size(), (step, i, held)  # while it ran
            assert buf.untyped_storage().nbytes() == 0, (step, i)  # given back at finalize
        buffers.clear()
        for opt in opts:
            opt.step()
    for (name, x), y in zip(ref.module.named_parameters(), ours.module.parameters()):
        assert torch.equal(x, y), f"{config_kwargs}: parameter {name}"


@pytest.mark.parametrize("config_kwargs", [
    dict(),  # the shared-memory group; the buffer path, as a callback reads the buffer
    dict(shared_memory_gradients=False),  # Gloo itself
    dict(shared_memory_gradients=False, batched_grad_copy=True),
], ids=["shm", "gloo", "batched"])
def test_lazy_buckets_hold_memory_only_while_their_step_runs(config_kwargs):
    # torch 2.15's DDP with the flag on where torch has it; else torch's plain DDP, whose
    # numbers the flag does not change.
    run_ranks(_lazy, world_size=2, config_kwargs=config_kwargs, torch_lazy=TORCH_HAS_LAZY)


def _views_keep(rank, world_size):
    ours = DDP(_model(), config=pycomm.DDPConfig(bucket_cap_mb=0.001, lazy_bucket_allocation=True,
                                                 gradient_as_bucket_view=True))
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(2):
        _step(ours, opt, rank, step)
        for index, (name, p) in enumerate(ours.reduced_named_parameters):
            # param.grad is the bucket's view: its memory stays
            assert p.grad.untyped_storage().nbytes() > 0, name
            assert p.grad.data_ptr() == ours.reducer.grad_view(index).data_ptr(), name
        opt.step()


def test_lazy_buckets_keep_memory_that_is_param_grad():
    run_ranks(_views_keep, world_size=2)


def test_the_argument_is_torchs_where_torch_has_it():
    pycomm_takes = "lazy_bucket_allocation" in inspect.signature(DDP.__init__).parameters
    assert pycomm_takes == TORCH_HAS_LAZY
    if not TORCH_HAS_LAZY:  # before any group is needed: torch's TypeError
        with pytest.raises(TypeError, match="unexpected keyword argument 'lazy_bucket_allocation'"):
            DDP(_model(), lazy_bucket_allocation=True)


def _argument(rank, world_size):
    ddp = DDP(_model(), lazy_bucket_allocation=True)
    assert ddp.config.lazy_bucket_allocation
    with pytest.raises(ValueError, match="either as arguments or in config"):
        DDP(_model(), lazy_bucket_allocation=True, config=pycomm.DDPConfig())


@pytest.mark.skipif(not TORCH_HAS_LAZY, reason=f"torch {torch.__version__}'s DDP has no "
                                               f"lazy_bucket_allocation (torch >= 2.15)")
def test_the_argument_sets_the_config():
    run_ranks(_argument, world_size=2)
