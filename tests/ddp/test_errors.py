"""Bad input and faults give clear errors naming the parameter, rank or bucket, on every
rank, and never a hang: unused parameters without find_unused_parameters, backward twice,
requires_grad changed, mismatched parameters across ranks, unimplemented torch arguments,
wrong process groups and devices, sparse gradients, communication hooks whose futures hold
the wrong thing, and a rank that dies mid-step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pycomm
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import exit_rank, run_ranks

DDP = pycomm.DistributedDataParallel


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _usage_errors(rank, world_size):
    ddp = DDP(build("branchy"), bucket_cap_mb=1e-6)
    out = ddp(make_input("mlp", rank, 0))
    # Names the unused parameters, on every rank, at the end of the backward that missed them.
    _raises(RuntimeError, r"unused\.weight.*find_unused_parameters", loss_of(out).backward)
    ddp = DDP(build("mlp"))
    loss = loss_of(ddp(make_input("mlp", rank, 0)))
    loss.backward(retain_graph=True)
    _raises(RuntimeError, r"net\.\d\.\w+ got a gradient after this step was already reduced",
            loss.backward)
    ddp.module.net[0].weight.requires_grad_(False)
    _raises(RuntimeError, r"net\.0\.weight no longer requires grad", ddp,
            make_input("mlp", rank, 0))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    _raises(RuntimeError, "doesn't have any parameter that requires a gradient", DDP, frozen)
    _raises(NotImplementedError, "mixed_precision", DDP, build("mlp"), mixed_precision=object())
    for name, value in (("param_to_hook_all_reduce", object()),
                        ("delay_all_reduce_named_params", [("w", None)])):
        _raises(ValueError, "at the same time", DDP, build("mlp"), **{name: value})
    _raises(TypeError, "ProcessGroup", DDP, build("mlp"), process_group="world")
    _raises(NotImplementedError, "sparse", DDP, nn.Embedding(4, 2, sparse=True))
    _raises(ValueError, "device_ids must be None", DDP, build("mlp"), device_ids=[0])
    _raises(ValueError, "SyncBatchNorm",
            DDP, nn.SyncBatchNorm.convert_sync_batchnorm(build("convbn")))
    _raises(ValueError, "either as arguments or in config", DDP, build("mlp"),
            find_unused_parameters=True, config=pycomm.DDPConfig())
    # A shape mismatch across ranks is an error naming the parameter on every rank.
    mismatched = nn.Linear(3, 2 + rank)
    _raises(RuntimeError, r"rank 0 has \('weight', \(2, 3\)", DDP, mismatched)
    # a parameter more on rank 1: counted and named, not "rank 0 has None"
    extra = nn.Sequential(nn.Linear(3, 2), *([nn.Linear(2, 2)] if rank == 1 else []))
    _raises(RuntimeError, r"rank 0 has 2 parameters to reduce, rank 1 has 4; the first beyond "
            r"the shorter list: \('1\.weight', \(2, 2\), 'torch\.float32'\) on rank 1", DDP, extra)
    dist.barrier()


def test_usage_errors_name_the_parameter_on_every_rank():
    run_ranks(_usage_errors, 2)


def _hook_returning(result):
    def hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(result(bucket))
        return fut
    return hook


def _bad_hook_results(rank, world_size):
    # Each names the hook's future and what it must hold, not pybind's cast error or a
    # view's "shape '[30]' is invalid for input of size 3".
    cases = [(lambda b: "not a tensor", r"communication hook's future holds a str; it must "
              r"hold one tensor shaped like bucket.buffer\(\)"),
             (lambda b: [b.buffer(), b.buffer()], r"communication hook's future holds 2 values"),
             (lambda b: b.buffer()[:3].clone(), r"the bucket's future holds a tensor of 3 "
              r"elements; the bucket has \d+ \(a communication hook must return")]
    for result, match in cases:
        ddp = DDP(build("mlp"), bucket_cap_mb=1e-6)
        ddp.register_comm_hook(None, _hook_returning(result))
        _raises(RuntimeError, match, loss_of(ddp(make_input("mlp", rank, 0))).backward)


def test_a_hook_future_holding_the_wrong_thing_is_named():
    run_ranks(_bad_hook_results, 2)


def _dead_rank(rank, world_size):
    ddp = DDP(build("mlp"), bucket_cap_mb=1e-6)
    out = loss_of(ddp(make_input("mlp", rank, 0)))
    if rank == 1:
        exit_rank()  # dies before its backward: rank 0's first bucket has no partner
    _raises(RuntimeError, r"rank 0\): the collective of bucket 0 of 6 .* failed or timed out",
            out.backward)


def test_dead_rank_fails_the_others_naming_the_bucket():
    run_ranks(_dead_rank, 2, group_timeout_s=10.0, deadline_s=60.0)
