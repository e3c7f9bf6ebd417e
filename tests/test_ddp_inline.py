"""DDPConfig.inline_collectives: each bucket's all-reduce runs on the backward thread as the
bucket completes (see Note [Inline collectives] in csrc/reducer/reducer.cpp). It must train
exactly as torch's DDP and as pycomm's asynchronous launch, finish every bucket before
backward moves on to the next bucket's gradients."""

import copy

import torch
import torch.nn as nn

import pycomm
from multirank import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(),
                         nn.Linear(300, 3))


def _train(ddp, rank, steps=3):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def _inline_matches_torch(rank, world):
    base = _model()
    cap = 0.1  # several buckets, so that several collectives run inline per backward
    inline = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=cap, inline_collectives=True))
    async_ = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(bucket_cap_mb=cap, inline_collectives=False))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    results = [_train(m, rank) for m in (inline, async_, ref)]
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
