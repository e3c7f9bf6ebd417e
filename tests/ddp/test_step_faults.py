"""Faults around a step, each first written as a failing reproduction: static_graph with
join() (a rank that joins before or after the step that learns the used parameters), the
wrapper deleted right after a backward that raised while a Python comm hook had buckets in
flight, the forward after such a backward (it recovers and says what was abandoned), and a
rank that dies inside backward after its peers launched buckets."""

from __future__ import annotations

import copy
import gc
import time
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import assert_same, build, loss_of, make_input, manual_average
from tests.support.multirank import exit_rank, run_ranks

DDP = pycomm.DistributedDataParallel


def _join_static(rank, world_size, steps_per_rank, find_unused):
    """pycomm with static_graph=True against torch's DDP without it (torch's own join hook
    does not shadow the usage all-reduce of static_graph's first step, so torch with
    static_graph is no oracle here); static_graph changes no number."""
    base = build("branchy")
    models = [TorchDDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=1e-6),
              DDP(copy.deepcopy(base), static_graph=True, find_unused_parameters=find_unused,
                  bucket_cap_mb=1e-6)]
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with m.join():
            for step in range(steps_per_rank[rank]):
                opt.zero_grad()
                loss_of(m(make_input("mlp", rank, step))).backward()
                opt.step()
        # After join the ranks train together again: the joined rank's reducer must be in
        # the same static-graph phase as the others.
        for step in range(2):
            opt.zero_grad()
            loss_of(m(make_input("mlp", rank, 50 + step))).backward()
            opt.step()
    # World 2: a 2-term sum and a 1/2 scale are exact whatever the order: bitwise.
    assert_same(models[0], models[1], f"static_graph join {steps_per_rank}", exact=True)


@pytest.mark.parametrize("steps,find_unused", [((3, 0), False), ((3, 1), True)],
                         ids=["joins-before-step-1", "joins-after-step-1-find-unused"])
def test_static_graph_with_join_shadows_the_usage_allreduce_exactly(steps, find_unused):
    run_ranks(_join_static, 2, group_timeout_s=10, deadline_s=60, steps_per_rank=steps,
              find_unused=find_unused)


def _raise(grad):
    raise RuntimeError("injected failure in backward")


def _failing_step(rank, hook, stagger_s=0.0):
    """A wrapper whose backward raises at the first layer's weight (ready last), after the
    later layers' buckets launched, on every rank alike; rank 1 starts its backward
    `stagger_s` later, so rank 0's launched bucket is still in flight when it moves on."""
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    # 300 B caps: bucket 0 holds layers 2 and 1, bucket 1 layer 0 (ready last).
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=300 / 2**20)
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp.register_comm_hook(None, allreduce_hook)
    handle = ddp.module[0].weight.register_hook(_raise)
    out = ddp(make_input("mlp", rank, 0))
    if rank == 1:
        time.sleep(stagger_s)
    with pytest.raises(RuntimeError, match="injected failure"):
        out.sum().backward()
    handle.remove()
    return base, ddp


def _delete_after_failed_backward(rank, world_size):
    _, ddp = _failing_step(rank, hook=True, stagger_s=2.0)
    del ddp
    gc.collect()  # ~Reducer drains collectives whose completion runs Python (the hook)
    fresh = DDP(build("mlp"))
    loss_of(fresh(make_input("mlp", rank, 1))).backward()


def test_deleting_the_wrapper_after_a_failed_backward_with_a_python_hook_returns():
    run_ranks(_delete_after_failed_backward, 2, group_timeout_s=10, deadline_s=40)


def _forward_after_failed_backward(rank, world_size, hook):
    base, ddp = _failing_step(rank, hook, stagger_s=1.0)  # the forward drains in-flight work
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ddp(make_input("mlp", rank, 1))
    text = " ".join(str(w.message) for w in caught)
    # Says exactly what was abandoned: the bucket that never launched and its parameter.
    assert "previous backward did not finish" in text, text
    assert "bucket 1 of 2" in text and "0.weight" in text, text
    ddp.zero_grad()
    loss_of(out).backward()  # the step after recovers cleanly
    plain = copy.deepcopy(base)
    loss_of(plain(make_input("mlp", rank, 1))).backward()
    manual_average(plain)
    # World 2: scaling by 1/2 before or after the sum is exact: bitwise either way.
    assert_same(plain, ddp.module, "the step after a failed backward", exact=True)


@pytest.mark.parametrize("hook", [False, True], ids=["allreduce", "python-hook"])
def test_forward_after_failed_backward_recovers_and_names_the_abandoned_bucket(hook):
    run_ranks(_forward_after_failed_backward, 2, group_timeout_s=10, deadline_s=40, hook=hook)


def _dies_in_backward(rank, world_size, shm):
    ddp = DDP(build("mlp"), config=pycomm.DDPConfig(bucket_cap_mb=1e-6,
                                                    shared_memory_gradients=shm))
    if rank == 1:
        ddp.module.net[0].weight.register_hook(lambda g: exit_rank())
    loss = loss_of(ddp(make_input("mlp", rank, 0)))
    if rank == 1:
        loss.backward()  # exits after launching buckets 0-3 (or 0-4) of 6
    # Which bucket rank 0 finds failed first depends on how far rank 1's collectives got
    # (the shared-memory backend runs them one by one on a worker); it is named either way.
    with pytest.raises(RuntimeError, match=r"rank 0\): the collective of bucket \d of 6 "
                                           r"\(\d+ bytes; parameters net\.\d\.\w+\) failed "
                                           r"or timed out: "):
        loss.backward()


@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "gloo"])
def test_rank_dying_mid_backward_fails_the_others_naming_the_bucket(shm):
    run_ranks(_dies_in_backward, 2, group_timeout_s=5, deadline_s=40, shm=shm)
