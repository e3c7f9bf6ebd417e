"""A rank whose steps fall out of line with the others'. A rank that runs a forward without
its backward, or a no_sync micro-step alone, would reduce its next step with the others'
previous one: torch's DDP lets that rank finish with parameters averaged against stale
gradients. pycomm's buckets carry their step's identity, compared in shared memory on its
own backend (See Note [Collective identity] in csrc/shm/collectives.cpp) and in one small
all-reduce per step on a Gloo group (Note [Step labels over the group] in
csrc/comm/step_label.cpp), so both ranks raise at that very collective, naming each other
and what each was at, well within the group timeout. What every rank does alike
(accumulation under no_sync, evaluation under torch.no_grad() on one rank only) trains
as torch's DDP, on both kinds of group."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import tanh_mlp
from tests.support.multirank import run_ranks

_TIMEOUT_S = 60.0  # the group's; every failure below must come long before it


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 24, generator=torch.Generator().manual_seed(100 * step + rank))


def _step(ddp, opt, x, backward=True):
    opt.zero_grad()
    loss = ddp(x).pow(2).mean()
    if backward:
        loss.backward()
        opt.step()


def _out_of_line(rank, world_size, lagging, how, shm):
    ddp = pycomm.DistributedDataParallel(tanh_mlp(), config=pycomm.DDPConfig(
        bucket_cap_mb=0.001, shared_memory_gradients=shm))
    # the shared-memory group, or the world's Gloo group
    assert (ddp.gradient_group is not dist.group.WORLD) == shm
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, _batch(rank, 0))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        for step in range(1, 4):
            if rank == lagging and step == 1:
                if how == "no backward":
                    _step(ddp, opt, _batch(rank, step), backward=False)
                else:
                    with ddp.no_sync():
                        _step(ddp, opt, _batch(rank, step))
            _step(ddp, opt, _batch(rank, step))
    elapsed = time.monotonic() - start
    said = str(raised.value)
    other = 1 - rank
    # Both ranks fail at the same collective, each naming both ranks and what each was at:
    # the lagging rank's bucket comes after 2 forwards since its last synchronized step.
    mine, theirs = (2, 1) if rank == lagging else (1, 2)
    assert f"ranks {rank} and {other} are in different collectives" in said, said
    assert (f"rank {rank} is at bucket 0 of its synchronized step 1, after {mine} forward(s)"
            in said), said
    assert (f"rank {other} at bucket 0 of its synchronized step 1, after {theirs} forward(s)"
            in said), said
    assert "skipped a backward" in said, said
    assert "frame #" not in said, said  # the backend's message, without a C++ backtrace
    if shm:  # the failed buckets, reduced in place, are not counted among the reduced ones
        assert re.search(r"bucket\(s\) 0(, \d+)*, reduced in place, failed partway", said), said
        assert "are already the reduced ones" not in said, said
    else:
        assert "the collective of bucket 0 of" in said, said
    assert elapsed < _TIMEOUT_S / 4, elapsed  # detected at once, not by the timeout


GROUPS = {"shared memory": True, "gloo": False}


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("how", ["no backward", "no_sync alone"])
def test_a_rank_out_of_line_fails_both_ranks_at_once(how, group):
    run_ranks(_out_of_line, 2, group_timeout_s=_TIMEOUT_S, lagging=1, how=how,
              shm=GROUPS[group])


def _in_line(rank, world_size, shm):
    base = tanh_mlp()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=0.001)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), config=pycomm.DDPConfig(
        bucket_cap_mb=0.001, shared_memory_gradients=shm))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(4):
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            with ddp.no_sync():  # accumulation, every rank alike
                ddp(_batch(rank, step)).pow(2).mean().backward()
            ddp(_batch(rank, step + 10)).pow(2).mean().backward()
            opt.step()
            if rank == 0:  # an evaluation on one rank only, as torch tolerates
                with torch.no_grad():
                    ddp(_batch(rank, step + 20))
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name  # 2 ranks: each sum one commutative addition


@pytest.mark.parametrize("group", GROUPS)
def test_what_every_rank_does_alike_trains_as_torch_ddp(group):
    run_ranks(_in_line, 2, shm=GROUPS[group])
