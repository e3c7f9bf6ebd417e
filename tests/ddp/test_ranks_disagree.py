"""Ranks that disagree on options. The bucket caps: torch's DDP adopts rank 0's rebuilt
bucket layout (bucket_cap_mb) and aborts where its first-step buckets differ
(bucket_cap_mb_list); pycomm adopts rank 0's caps at construction, warns on every rank with
each rank's value, and trains as torch's DDP does (with the same per-rank arguments where
torch trains, with rank 0's everywhere where it aborts). Any other option that decides the
ranks' collectives raises a ValueError on every rank, naming it and each rank's value,
before any collective could go astray; the per-rank options may differ."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import tanh_mlp, train_sgd
from tests.support.multirank import run_ranks


def _caps_differ(rank, world_size, caps, shown, torch_reconciles=True):
    base = tanh_mlp()
    kwargs = caps[rank]
    # torch's DDP given the same per-rank arguments where it trains with them, else given
    # rank 0's on every rank (what pycomm adopts)
    ref = TorchDDP(copy.deepcopy(base), **(kwargs if torch_reconciles else caps[0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = pycomm.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    said = [str(w.message) for w in caught if "bucket caps differ" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    for r, text in enumerate(shown):
        assert f"rank {r}: {text}" in said[0], said[0]
    want = ours.config.bucket_byte_limits()
    limits = [None] * world_size
    dist.all_gather_object(limits, want)
    assert all(x == limits[0] for x in limits), limits  # every rank on rank 0's caps
    for a, b in zip(train_sgd(ref, rank, steps=4), train_sgd(ours, rank, steps=4)):
        assert a.equal(b)  # 2 ranks: each element one commutative addition


def test_bucket_cap_mb_differs_across_ranks_and_trains_as_torch():
    run_ranks(_caps_differ, 2, caps=[{"bucket_cap_mb": 0.3}, {"bucket_cap_mb": 25.0}],
              shown=["bucket_cap_mb=0.3", "bucket_cap_mb=25"])


def test_bucket_cap_mb_list_on_one_rank_only_trains_on_rank_0s_caps():
    # torch 2.13's DDP aborts here (Gloo: "Received data size doesn't match expected
    # size", checked by hand): its step-1 buckets differ across ranks. pycomm trains as
    # torch's DDP does with rank 0's caps on both ranks.
    run_ranks(_caps_differ, 2, caps=[{}, {"bucket_cap_mb_list": [0.01, 0.1]}],
              shown=["torch's defaults", "bucket_cap_mb_list=[0.01, 0.1]"],
              torch_reconciles=False)


def _options_differ(rank, world_size, options):
    with pytest.raises(ValueError) as raised:
        pycomm.DistributedDataParallel(tanh_mlp(), config=pycomm.DDPConfig(**options[rank]))
    said = str(raised.value)
    assert "the ranks' options differ" in said, said
    for name in options[1]:
        values = ", ".join(f"rank {r}: {o.get(name, getattr(pycomm.DDPConfig(), name))!r}"
                           for r, o in enumerate(options))
        assert f"{name} ({values})" in said, said
    dist.barrier()  # nothing else ran: the group is fine


@pytest.mark.parametrize("differ", [
    # Before: rank 1's static_graph / find_unused_parameters failed inside assign_buckets;
    # shared_memory_gradients hung rank 0 in a store wait until the group timeout.
    {"find_unused_parameters": True, "static_graph": True},
    {"shared_memory_gradients": False},
    {"grad_reduce_dtype": torch.float64, "local_clip_max_norm": 1.0},
], ids=["graph", "shared-memory", "dtype-and-clip"])
def test_options_that_decide_collectives_must_agree_on_every_rank(differ):
    run_ranks(_options_differ, 2, options=[{}, differ])


def _per_rank_options(rank, world_size):
    base = tanh_mlp()
    ref = TorchDDP(copy.deepcopy(base))
    config = pycomm.DDPConfig(record_timeline=rank == 0, inline_collectives=rank == 1,
                              streaming_copies=rank == 0, in_place_reduction=rank == 1,
                              gradient_as_bucket_view=rank == 0)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), config=config)
    for a, b in zip(train_sgd(ref, rank, steps=3), train_sgd(ours, rank, steps=3)):
        assert a.equal(b)


def test_per_rank_options_may_differ():
    run_ranks(_per_rank_options, 2)
