"""What a bucket's collective keeps of the thread that launched it (Note [No Python object in a
collective's thread state] in csrc/comm/thread_state.h).

Gloo's Work, and every callback added to a future, keep a copy of the issuing thread's
thread-local state and drop it on Gloo's worker thread. During a backward torch puts a
Python object there (the caller's contextvars.Context), and a worker dropping the last
copy of it as the interpreter finalizes aborts the process. pycomm's reducer launches its
buckets with the thread's Python objects set aside.

The check: a probe object is put in the thread's Python-object state before backward, as
torch puts its context (a hook cannot: autograd restores the state around each node), and
the step is finalized by hand (torch 2.15's require_manual_backward_finalization), so
that backward returns with the buckets' collectives still in flight: the other rank is
late. Then the probe is taken out of the state and must be gone at once: nothing the
launches left behind holds it. torch's DDP, which launches with the state as it is,
keeps it alive until its collectives end: the same check, reversed, shows that it can
fail."""

from __future__ import annotations

import copy
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm.ddp.finalization import TORCH_HAS_MANUAL_FINALIZATION
from tests.support.multirank import run_ranks

KEY = "pycomm_test_probe"


class _Probe:
    pass


def _probe_outlives_backward(ddp: torch.nn.Module, rank: int) -> bool:
    """One step finalized by hand; whether the probe outlived its removal from the state
    while the step's collectives were in flight (on the rank that did not wait)."""
    loss = ddp(torch.randn(8, 16)).square().mean()
    if rank == 1:
        time.sleep(1.0)  # rank 0's collectives wait for this rank meanwhile
    probe = _Probe()
    ref = weakref.ref(probe)
    torch._C._stash_obj_in_tls(KEY, probe)
    del probe
    loss.backward()
    torch._C._remove_obj_from_tls(KEY)
    alive = ref() is not None
    ddp.finalize_backward()
    return alive


def _launches(rank, world):
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    ours = pycomm.DistributedDataParallel(
        copy.deepcopy(base),
        config=pycomm.DDPConfig(bucket_cap_mb=1e-3, shared_memory_gradients=False))
    theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=1e-3)
    assert dist.get_backend(ours.gradient_group) == "gloo"
    for ddp in (ours, theirs):
        ddp.require_manual_backward_finalization = True
    for step in range(2):  # the first step of each builds its buckets
        survived = {"pycomm": _probe_outlives_backward(ours, rank),
                    "torch": _probe_outlives_backward(theirs, rank)}
        dist.barrier()
        if rank == 0:
            assert survived == {"pycomm": False, "torch": True}, (step, survived)


@pytest.mark.skipif(not TORCH_HAS_MANUAL_FINALIZATION,
                    reason=f"torch {torch.__version__}'s DDP has no manual backward "
                           "finalization (torch >= 2.15), which the check needs")
def test_bucket_collectives_keep_no_python_object_of_the_launching_thread():
    run_ranks(_launches, world_size=2)
