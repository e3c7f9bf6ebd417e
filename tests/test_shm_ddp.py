"""pycomm's DDP on a same-host Gloo group reduces its gradients through the shared-memory
backend by itself (DDPConfig.shared_memory_gradients), and trains exactly as with the
option off and as torch's DDP on Gloo."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm
from multirank import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(),
                         nn.Linear(300, 3))


def _train(ddp, rank, steps=3):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def _shm_gradients(rank, world):
    base = _model()
    # A small cap: several buckets, the first ones under the parallel-reduction threshold.
    on = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)
    off = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=0.1,
                                                     shared_memory_gradients=False))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)
    assert dist.get_backend(on._gradient_pg) == "pycomm"
    assert off._gradient_pg is dist.group.WORLD and on.process_group is dist.group.WORLD
    results = [_train(m, rank) for m in (on, off, ref)]
    for a, b, c in zip(*results):
        if world == 2:
            # Each gradient element is one fp32 addition of two halves: commutative, exact.
            assert torch.equal(a, b) and torch.equal(a, c)
        else:
            # Three terms are added in rank order here and in Gloo's ring order there:
            # fp32 rounding of a 3-term sum, grown over 3 momentum steps.
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_pycomm_ddp_reduces_over_shared_memory(world_size):
    run_ranks(_shm_gradients, world_size=world_size, backend="gloo")
