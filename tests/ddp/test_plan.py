"""The reducer's plan (Note [The reducer's plan] in csrc/reducer/plan.h): decided once when
the DDP is built, when a sharder attaches and when buckets are re-cut, and read whole as
ddp.plan; nothing sets a mode piece by piece. Each case checks the plan and that a step
then takes it (param.grad where the gradients stay whole, none where they are released),
against torch's DDP on the same inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm import _C
from pycomm.ddp.sharding import ShardedReduction
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks


def _step(model, rank, step=0):
    model.zero_grad(set_to_none=True)
    loss_of(model(make_input("mlp", rank, step))).backward()


def _plans(rank, world_size):
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    _step(ref, rank)

    # the default over a same-host group: every bucket reduced where its gradients are
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.002)
    plan = ddp.plan
    buckets = len(ddp.bucket_indices())
    assert buckets > 1
    assert (plan["sharding"], plan["wire"], plan["releases"], plan["reducer_averages"]) == (
        "none", pycomm.Wire(), False, True)
    assert plan["reduction"] == "allreduce"
    assert plan["paths"] == ["in_place"] * buckets
    _step(ddp, rank)
    for p, q in zip(ddp.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad)

    # options that keep buckets on their buffers, decided at construction
    for kwargs in ({"config": pycomm.DDPConfig(in_place_reduction=False)},
                   {"gradient_as_bucket_view": True}, {"find_unused_parameters": True},
                   {"static_graph": True}):
        other = pycomm.DistributedDataParallel(copy.deepcopy(base), **kwargs)
        assert set(other.plan["paths"]) == {"buffer"}, kwargs

    # a user's hook: it averages, no wire, the buffers
    hooked = pycomm.DistributedDataParallel(copy.deepcopy(base))
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    hooked.register_comm_hook(hooked.gradient_group, allreduce_hook)
    plan = hooked.plan
    assert plan["wire"] is None and not plan["reducer_averages"]
    assert plan["reduction"] == "python_hook"
    assert set(plan["paths"]) == {"buffer"}
    # a sharder cannot replace it, and the refusal changes nothing
    with pytest.raises(RuntimeError, match="already has a communication hook"):
        pycomm.ZeroRedundancyOptimizer(hooked.parameters(), torch.optim.SGD, lr=0.1,
                                       release_gradients=True)
    assert hooked.plan == plan
    # one that keeps the gradients whole leaves the user's hook reducing them
    pycomm.ZeroRedundancyOptimizer(hooked.parameters(), torch.optim.SGD, lr=0.1)
    assert hooked.plan == dict(plan, sharding="optimizer_state")

    # the sharded optimizer's modes
    kept = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.002)
    pycomm.ZeroRedundancyOptimizer(kept.parameters(), torch.optim.SGD, lr=0.1)
    assert kept.plan["sharding"] == "optimizer_state"
    assert kept.plan["paths"] == ["in_place"] * len(kept.bucket_indices())

    released = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.002)
    zero = pycomm.ZeroRedundancyOptimizer(released.parameters(), torch.optim.SGD, lr=0.1,
                                          release_gradients=True)
    plan = released.plan
    assert (plan["sharding"], plan["wire"], plan["releases"], plan["reducer_averages"]) == (
        "released", None, True, True)
    # reduced and kept in C++, no trip through Python (Note [Shards kept in C++])
    assert plan["reduction"] == "shard_keep"
    # before the one bucket re-cut whole buckets are all-reduced through their buffers
    assert set(plan["paths"]) == {"released"}
    _step(released, rank)
    assert all(p.grad is None for p in released.module.parameters())
    zero.step()  # re-cuts the buckets, cuts the shards: the sharder attaches again
    plan = released.plan
    assert (plan["sharding"], plan["reduction"]) == ("released", "shard_keep")
    assert plan["paths"] == ["released_in_place"] * len(released.bucket_indices())
    _step(released, rank, 1)
    assert all(p.grad is None for p in released.module.parameters())
    zero.step()

    # a second optimizer keeping the gradients whole takes the reduction back: the default
    # all-reduce again, and join's shadow (ddp._sync.comm_hook) follows it
    pycomm.ZeroRedundancyOptimizer(released.parameters(), torch.optim.SGD, lr=0.1)
    assert released.plan["sharding"] == "optimizer_state"
    assert released.plan["reduction"] == "allreduce"
    assert released.plan["wire"] == "fp32" and released._sync.comm_hook is None
    _step(released, rank, 2)
    for p, q in zip(released.module.parameters(), ref.module.parameters()):
        assert p.grad is not None and p.grad.shape == q.grad.shape

    # with grad_reduce_dtype the released mode keeps its buckets (no_sync's fp32 sums)
    wide = pycomm.DistributedDataParallel(copy.deepcopy(base).bfloat16(),
                                          config=pycomm.DDPConfig(
                                              grad_reduce_dtype=torch.float32))
    pycomm.ZeroRedundancyOptimizer(wide.parameters(), torch.optim.SGD, lr=0.1,
                                   release_gradients=True)
    assert (wide.plan["sharding"], wide.plan["releases"]) == ("released", False)
    assert set(wide.plan["paths"]) == {"buffer"}

    # the mode setters are gone: a sharder attaches whole
    for name in ("set_release_gradients", "set_comm_hook_in_place"):
        assert not hasattr(ddp.reducer, name), name
    with pytest.raises(RuntimeError, match="a hook comes with the released mode"):
        ddp.reducer.attach_sharding(_C.Sharding.RELEASED)
    with pytest.raises(TypeError, match="is not a sharder"):
        ddp.attach_sharder(object(), ShardedReduction(_C.Sharding.OPTIMIZER_STATE))
    assert ddp.plan["sharding"] == "none"


def test_the_plan_is_decided_once_and_taken_by_every_step():
    run_ranks(_plans, 2)
