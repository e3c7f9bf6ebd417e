"""pycomm's DDP on a same-host Gloo group reduces its gradients through the shared-memory
backend by itself (DDPConfig.shared_memory_gradients), and trains exactly as with the
option off and as torch's DDP on Gloo."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm
import pycomm.shm
from tests.support.ddp_models import tanh_mlp, train_sgd
from tests.support.multirank import run_ranks


def _shm_gradients(rank, world):
    base = tanh_mlp()
    # A small cap: several buckets, the first ones under the parallel-reduction threshold.
    on = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)
    off = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=0.1,
                                                     shared_memory_gradients=False))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)
    assert dist.get_backend(on.gradient_group) == "pycomm"
    assert off.gradient_group is dist.group.WORLD and on.process_group is dist.group.WORLD
    before = pycomm.shm.stats(on.gradient_group)
    results = [train_sgd(m, rank) for m in (on, off, ref)]
    after = pycomm.shm.stats(on.gradient_group)
    ran = sum(after[k] - before[k] for k in ("ops_on_caller_thread", "ops_on_worker_thread"))
    assert ran >= len(on.reducer.bucket_indices()), (before, after)
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


def _group_by_device(rank, world):
    from pycomm.ddp.args import gradient_group

    cfg = pycomm.DDPConfig()
    assert dist.get_backend(gradient_group(dist.group.WORLD, cfg, torch.device("cpu"))) == \
        "pycomm"
    # CUDA gradients on a Gloo group stay on Gloo: the shared-memory backend reduces host
    # memory only (tests/gpu/test_ddp_on_cuda.py trains such a module).
    assert gradient_group(dist.group.WORLD, cfg, torch.device("cuda", 0)) is dist.group.WORLD


def test_only_host_memory_gradients_take_the_shared_memory_group():
    run_ranks(_group_by_device, world_size=2, backend="gloo")
