"""Ranks that disagree on the bucket caps. torch's DDP adopts rank 0's rebuilt bucket
layout (bucket_cap_mb) and aborts where its first-step buckets differ (bucket_cap_mb_list);
pycomm adopts rank 0's caps at construction, warns on every rank with each rank's value,
and trains as torch's DDP does (with the same per-rank arguments where torch trains, with
rank 0's everywhere where it aborts)."""

from __future__ import annotations

import copy
import warnings

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
