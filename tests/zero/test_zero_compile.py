"""pycomm.ZeroRedundancyOptimizer under torch.compile, both ways pycomm's DDP is compiled
(torch.compile(ddp), and ddp.module = torch.compile(ddp.module)): the same parameters as
eager, bit for bit (aot_eager keeps eager numerics), and no graph beyond the ones the
plain DDP compiles to (its forward pre-hooks are nothing to dynamo: the DDP's eager
forward waits for the pending all-gathers before a compiled call, so none is left pending
once the compiled module ran; on this small model they would mostly be done by the time
it reads, which is why pending ones are looked for and not only the numbers)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pycomm
from tests.support.multirank import run_ranks

WIDTH = 64


def _model():
    torch.manual_seed(3)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def _data(rank, step):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _run(base, rank, how, sharded, steps=5):
    from torch._dynamo.testing import CompileCounterWithBackend

    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base),
                                         config=pycomm.DDPConfig(bucket_cap_mb=0.02))
    opt = (pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                          overlap_with_ddp=True) if sharded
           else torch.optim.AdamW(ddp.parameters(), lr=1e-2))
    count = CompileCounterWithBackend("aot_eager")
    run = ddp
    if how == "ddp":
        run = torch.compile(ddp, backend=count)
    elif how == "module":
        ddp.module = torch.compile(ddp.module, backend=count)
    for step in range(steps):
        opt.zero_grad()
        loss = run(_data(rank, step)).square().mean()
        if sharded:  # what the module read was gathered: nothing still pending
            assert not opt._pending, f"step {step}: all-gathers pending after the forward"
        loss.backward()
        opt.step()
    if sharded:
        opt.wait_for_params()
    return ddp, count.frame_count


def _compiled(rank, world_size, how):
    torch._dynamo.reset()
    base = _model()
    eager, _ = _run(base, rank, None, sharded=True)
    plain, plain_graphs = _run(base, rank, how, sharded=False)
    ours, graphs = _run(base, rank, how, sharded=True)
    assert graphs == plain_graphs, (graphs, plain_graphs)
    for p, q, r in zip(ours.parameters(), eager.parameters(), plain.parameters()):
        assert torch.equal(p, q), "compiled differs from eager"
        assert torch.equal(p, r), "sharded differs from the plain DDP + AdamW"


@pytest.mark.parametrize("how", ["ddp", "module"])
def test_compiled_sharded_training_equals_eager(how):
    run_ranks(_compiled, 2, how=how)
