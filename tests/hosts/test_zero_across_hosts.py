"""pycomm.ZeroRedundancyOptimizer across real hosts (network namespaces,
pycomm/testing/hosts.py), 2 hosts x 2 ranks: buckets reduce-scattered and parameters
all-gathered hierarchically (Note [Hierarchical reduce-scatter and all-gather] in
csrc/shm/hier.h). Against pycomm's DDP + AdamW on the same hierarchy: each element the sum
of its host's two ranks, then of the two hosts, as the hierarchical all-reduce adds them,
so bitwise equal."""

from __future__ import annotations

import copy

import torch

import pycomm
import pycomm.shm
from pycomm.testing.hosts import Hosts
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.hosts_fixture import needs_hosts, nothing_left_behind  # noqa: F401

pytestmark = needs_hosts


def _sharded_across_hosts(rank, world_size, steps=6):
    base = build("mlp")
    cfg = pycomm.DDPConfig(bucket_cap_mb=5e-4)
    sharded = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    zero = pycomm.ZeroRedundancyOptimizer(sharded.parameters(), torch.optim.AdamW, lr=1e-2,
                                          overlap_with_ddp=True)
    plain = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(steps):
        for ddp, opt in ((sharded, zero), (plain, adamw)):
            opt.zero_grad()
            loss_of(ddp(make_input("mlp", rank, step))).backward()
            opt.step()
    zero.wait_for_params()
    for (name, p), q in zip(sharded.module.named_parameters(), plain.module.parameters()):
        assert torch.equal(p, q), f"rank {rank}: {name} differs by {(p - q).abs().max()}"
    state = sum(t.numel() for s in zero.optim.state.values() for t in s.values()
                if t.dim() > 0)
    return (pycomm.shm.hierarchy(sharded.gradient_group), zero._hook_state.keep.reduce_scatter,
            state, 2 * sum(p.numel() for p in base.parameters()))


def test_sharded_optimizer_across_hosts_equals_ddp():
    with Hosts(2) as hosts:
        values = [r.value for r in hosts.run(_sharded_across_hosts, ranks_per_host=2,
                                             timeout=240, group_timeout_s=60)]
    for rank, (hierarchy, reduce_scatter, state, whole) in enumerate(values):
        assert hierarchy == {"host": rank // 2, "hosts": 2, "local_rank": rank % 2,
                             "ranks_per_host": 2}
        assert reduce_scatter
        assert state <= whole / 4 + 2 * 4 * 8, (state, whole)
