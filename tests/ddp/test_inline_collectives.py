"""DDPConfig.inline_collectives: each bucket's all-reduce runs on the backward thread as the
bucket completes (see Note [Inline collectives] in csrc/reducer/launch.cpp). It must train
exactly as torch's DDP and as pycomm's asynchronous launch, finish every bucket before
backward moves on to the next bucket's gradients."""

import copy

import torch
import torch.nn as nn

import pycomm
from tests.support.ddp_models import tanh_mlp, train_sgd
from tests.support.multirank import run_ranks


def _inline_matches_torch(rank, world):
    base = tanh_mlp()
    cap = 0.1  # several buckets, so that several collectives run inline per backward
    inline = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=cap, inline_collectives=True))
    async_ = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=cap, inline_collectives=False))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    results = [train_sgd(m, rank) for m in (inline, async_, ref)]
    for a, b, c in zip(*results):
        # Two ranks: each element is one fp32 addition of two pre-scaled halves,
        # commutative and exact, whichever thread runs it.
        assert torch.equal(a, b) and torch.equal(a, c)
    for step in inline.timelines(3):
        buckets = step["buckets"]
        assert len(buckets) > 1
        for done, later in zip(buckets, buckets[1:]):
            # Inline: the backward thread itself waited for this bucket's collective, so
            # it completed before any later bucket could be complete.
            assert 0 < done["done_ns"] <= later["ready_ns"], (done, later)


def test_inline_collectives_train_as_torch_and_finish_each_bucket_in_turn():
    run_ranks(_inline_matches_torch, world_size=2, backend="gloo")
