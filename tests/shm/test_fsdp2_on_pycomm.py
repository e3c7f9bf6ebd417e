"""torch's FSDP2 (fully_shard) on a pycomm group, against FSDP2 on a Gloo group of the same
ranks: AdamW, reshard after forward on and off, mixed precision (bf16 parameters, fp32
gradient reduction). The parameters are bitwise Gloo's at 2 and 3 ranks: from 3 on, the
order of a sum's terms shows in its bits, and the shared-memory backend adds them in
Gloo's ring order (Note [Gloo's summation order] in csrc/shm/sum_order.h)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pycomm.shm
from tests.support.multirank import run_ranks


def _train(group, reshard: bool, mixed: bool, rank: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    options = {"mesh": DeviceMesh.from_group(group, "cpu"), "reshard_after_forward": reshard}
    if mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **options)
    fully_shard(model, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).float().square().mean().backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _fsdp2_both(rank, world):
    shm = dist.new_group(backend="pycomm")
    gloo = dist.new_group(backend="gloo")
    for reshard in (True, False):
        for mixed in (False, True):
            theirs = _train(gloo, reshard, mixed, rank)
            ours = _train(shm, reshard, mixed, rank)
            for a, b in zip(ours, theirs):
                assert torch.equal(a, b), (world, reshard, mixed, (a - b).abs().max())


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_on_a_pycomm_group_trains_as_on_gloo(world_size):
    run_ranks(_fsdp2_both, world_size=world_size)


def _fsdp2_across_hosts(rank, world, wire):
    """2 pretend hosts x 2 ranks: FSDP2 on a hierarchical pycomm group (shared memory
    within a host, Gloo across), its all-gathers and reduce-scatters the hierarchy's, against
    FSDP2 on Gloo. fp32: each gradient summed by host, then across hosts, where Gloo's ring
    adds in another order: float rounding apart. With the group's bf16 wire each host's sums
    cross rounded once to bf16 and are added in float32."""
    from tests.shm.test_hierarchical_on_one_host import _pretend_hosts

    _pretend_hosts(rank, [2, 2])
    hier = dist.new_group(backend="pycomm", pg_options=pycomm.shm.Options(wire=wire))
    assert pycomm.shm.hierarchy(hier)["hosts"] == 2
    gloo = dist.new_group(backend="gloo")
    for reshard in (True, False):
        for mixed in (False, True):
            theirs = _train(gloo, reshard, mixed, rank)
            ours = _train(hier, reshard, mixed, rank)
            tol = 1e-5 if wire == "fp32" else 2e-2
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol,
                                           msg=f"{wire} reshard={reshard} mixed={mixed}")
    ops = {r["op"] for r in pycomm.shm.flight_record(hier)}
    rs = "reduce_scatter_tensor" + ("" if wire == "fp32" else f"[wire={wire}]")
    assert {rs, "all_gather_into_tensor"} <= ops, ops


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_fsdp2_across_hosts_on_the_hierarchy(wire):
    run_ranks(_fsdp2_across_hosts, world_size=4, wire=wire)
