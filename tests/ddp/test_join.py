"""fp32 reduction of bf16 gradients, and join() with uneven inputs (also after
_set_static_graph), against torch's DDP."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import assert_same, build, loss_of, make_input
from tests.support.multirank import run_ranks


def _reduce_in_fp32(rank, world_size):
    base = build("mlp").to(torch.bfloat16)
    plain = copy.deepcopy(base)
    cfg = pycomm.DDPConfig(grad_reduce_dtype=torch.float32, bucket_cap_mb=1e-3)
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    x = make_input("mlp", rank, 0).to(torch.bfloat16)
    loss_of(ddp(x)).backward()
    loss_of(plain(x)).backward()
    for (name, p), q in zip(plain.named_parameters(), ddp.module.parameters()):
        # Oracle, written out: widen, scale by 1/world in fp32, sum in fp32.
        want = p.grad.float() * (1.0 / world_size)
        dist.all_reduce(want)
        assert q.main_grad.dtype == torch.float32
        assert torch.equal(q.main_grad, want), name
        assert torch.equal(q.grad, want.to(torch.bfloat16)), name


def _join_uneven(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    # shm=False: on the Gloo group a joined rank shadows each step's label exchange with
    # zeros (Note [Step labels over the group] in csrc/comm/step_label.cpp).
    for divide, hook, shm in ((True, False, True), (False, False, True), (True, True, True),
                              (True, False, False), (True, True, False)):
        base = build("mlp")
        models = [TorchDDP(copy.deepcopy(base)),
                  pycomm.DistributedDataParallel(copy.deepcopy(base), config=pycomm.DDPConfig(
                      bucket_cap_mb=1e-3, shared_memory_gradients=shm))]
        for m in models:
            if hook:  # joined ranks shadow the buckets through the hook
                m.register_comm_hook(None, allreduce_hook)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            with m.join(divide_by_initial_world_size=divide):
                for step in range(2 + 2 * rank):
                    opt.zero_grad()
                    loss_of(m(make_input("mlp", rank, step))).backward()
                    opt.step()
        assert_same(models[0], models[1], f"join divide={divide} hook={hook} shm={shm}",
                    exact=True, grads=False)


def _join_after_set_static_graph(rank, world_size):
    # _set_static_graph() inside join() rebuilds the reducer: a joined rank must shadow the
    # new one's buckets (the hook asks for the wrapper's current ForwardSync each time).
    base = build("mlp")
    models = [pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3,
                                             static_graph=True),
              pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)]
    for late, m in enumerate(models):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with m.join():
            if late:
                m._set_static_graph()
            for step in range(2 + 2 * rank):
                opt.zero_grad()
                loss_of(m(make_input("mlp", rank, step))).backward()
                opt.step()
    assert_same(models[0], models[1], "join after _set_static_graph", exact=True,
                grads=False)


def test_reduce_bf16_grads_in_fp32_and_join_uneven_inputs():
    run_ranks(_reduce_in_fp32, 2)
    run_ranks(_join_uneven, 2)
    run_ranks(_join_after_set_static_graph, 2)
