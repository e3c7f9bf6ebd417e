"""How a "pycomm" backend ends and what it tells torch on the way: dropped with an
operation still running, shut down, its abort hooks at the group's first failure and its
completion hooks (torch 2.15's hook API, Hooks.hpp). Real ranks; the backends are made by
pycomm.shm.create_backend as torch's creator call makes them."""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

import pycomm.shm
from tests.support.multirank import run_ranks

_OP_TIMEOUT_S = 1.0  # how long an operation waits for a rank that never comes
_KINDS = pytest.mark.parametrize("hosts", [False, True], ids=["shm", "hierarchical"])
_HOOK_API = hasattr(dist.ProcessGroup, "supports_abort_hooks")  # torch 2.15
_no_hook_api = pytest.mark.skipif(not _HOOK_API, reason="this torch's c10d has no "
                                  "supportsAbortHooks / completion hooks (torch 2.15 has)")


def _backend(rank, world, hosts, prefix):
    if hosts:  # every rank a host of its own: the hierarchical backend (csrc/shm/hier.h)
        pycomm.shm.host_identity = lambda: f"host{rank}/boot"
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    timeout = datetime.timedelta(seconds=_OP_TIMEOUT_S)
    backend = pycomm.shm.create_backend(store, rank, world, timeout)
    assert isinstance(backend, pycomm._C.HierBackend if hosts else pycomm._C.ShmBackend)
    return store, backend


def _group_of(store, rank, world, backend):
    """A ProcessGroup over `backend` alone, to issue operations through torch's dispatcher."""
    group = dist.ProcessGroup(store, rank, world)
    group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
    return group


def _meet(store, world, name):
    store.set(f"{name}/{dist.get_rank()}", "1")
    store.wait([f"{name}/{r}" for r in range(world)], datetime.timedelta(seconds=60))


def _wait_until_running(backend, hosts):
    """Until the worker runs the all-reduce: the shared-memory one waiting for rank 1. The
    hierarchical one, with one rank per host, has no local phase to record (Note [One rank
    per host] in csrc/shm/hier_allreduce.cpp) and goes across hosts at once: its worker
    takes it within microseconds, so half a second leaves it waiting for rank 1 there."""
    if hosts:
        time.sleep(0.5)
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        record = backend.flight_record()
        if record and record[-1]["state"] == "started":
            return
        time.sleep(0.01)
    raise AssertionError(f"the all-reduce never started: {record}")


def _drop_in_flight(rank, world, hosts):
    store, backend = _backend(rank, world, hosts, "dropped/")
    if rank == 0:
        group = _group_of(store, rank, world, backend)
        # Run by the backend's worker, which holds the only reference to the tensor once
        # Python drops its own: releasing it there takes the GIL.
        group.allreduce([torch.ones(4)])
        del group
        _wait_until_running(backend, hosts)
        start = time.monotonic()
        del backend  # the last reference: the destructor waits for the worker
        waited = time.monotonic() - start
        # The worker ends when the all-reduce times out; no later than a few timeouts.
        assert waited < 10 * _OP_TIMEOUT_S, waited
    _meet(store, world, "through")


@_KINDS
def test_dropping_a_backend_with_an_operation_in_flight_returns(hosts):
    # The deadline turns a destructor that never returns into a failure.
    run_ranks(_drop_in_flight, world_size=2, backend="gloo", deadline_s=60, hosts=hosts)


def _shut_down(rank, world, hosts):
    store, backend = _backend(rank, world, hosts, "shut/")
    group = _group_of(store, rank, world, backend)
    t = torch.ones(4)
    group.allreduce([t]).wait()
    assert torch.equal(t, torch.full((4,), float(world)))
    group.shutdown()  # what destroy_process_group calls on every group
    with pytest.raises(RuntimeError, match="has been shut down"):
        group.allreduce([torch.ones(4)])
    _meet(store, world, "through")


@_KINDS
def test_a_shut_down_backend_refuses_new_operations(hosts):
    run_ranks(_shut_down, world_size=2, backend="gloo", deadline_s=60, hosts=hosts)


def _abort_hooks(rank, world, hosts):
    store, backend = _backend(rank, world, hosts, "abort/")
    group = _group_of(store, rank, world, backend)
    if hosts:  # the hierarchical group has none: torch's own refusal, not a crash
        assert not group.supports_abort_hooks
        with pytest.raises(RuntimeError, match="does not support registerAbortHook"):
            group.register_abort_hook(1, lambda: None)
    elif rank == 0:
        assert group.supports_abort_hooks
        ran = []
        group.register_abort_hook(101, lambda: ran.append("kept"))
        group.register_abort_hook(102, lambda: ran.append("removed"))
        group.unregister_abort_hook(102)
        group.unregister_abort_hook(103)  # never registered: nothing to do
        with pytest.raises(dist.DistBackendError, match="Timed out"):
            group.allreduce([torch.ones(2)]).wait()  # rank 1 never comes
        deadline = time.monotonic() + 10  # the hooks run beside the failing call
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["kept"]
        with pytest.raises(dist.DistBackendError, match="unusable after an earlier failure"):
            group.allreduce([torch.ones(2)]).wait()
        assert ran == ["kept"]  # at the group's first failure only
    _meet(store, world, "through")


@_no_hook_api
@_KINDS
def test_abort_hooks_run_at_the_first_failure(hosts):
    run_ranks(_abort_hooks, world_size=2, backend="gloo", deadline_s=60, hosts=hosts)


def _completions(rank, world):
    from torch._C._distributed_c10d import _dump_fr_trace_json

    group = dist.new_group(backend="pycomm")
    assert group._get_backend(torch.device("cpu")).supports_completion_hooks
    t = torch.ones(8)
    dist.all_reduce(t, group=group)  # blocking: run on this thread
    dist.all_reduce(t, group=group, async_op=True).wait()  # on the worker, or by wait()
    dist.broadcast(t, src=0, group=group, async_op=True).get_future().wait()
    dist.barrier(group=group)
    trace = json.loads(_dump_fr_trace_json(includeCollectives=True, backend="pycomm"))
    states = [e["state"] for e in trace["entries"] if e["process_group"][0] == group.group_name]
    # Without completion hooks torch retires each entry when it is issued: "scheduled".
    assert states == ["completed"] * 4, states


@_no_hook_api
@pytest.mark.skipif(os.environ.get("TORCH_FR_BUFFER_SIZE") == "0",
                    reason="torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)")
def test_torch_flight_recorder_sees_operations_complete():
    run_ranks(_completions, world_size=2, backend="gloo")
