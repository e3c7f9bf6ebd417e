"""The "pycomm" torch.distributed backend: shared-memory collectives between the ranks of
one host, implemented in C++ (csrc/shm/). This module owns its registration and its
rendezvous; the collectives, waits and Work objects live in the extension.

Rendezvous goes only through the c10d store torch hands the creator (already prefixed per
group): every rank publishes a host identity, and the group refuses to form unless all
ranks share it; rank 0 creates a segment under a random name (owner-only permissions),
publishes the name, waits until every rank has mapped it and unlinks it at once, so
/dev/shm keeps nothing of ours whatever happens later.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket

import torch
import torch.distributed as dist

from . import _C
from .objects import all_gather_object

BACKEND_NAME = "pycomm"

_SEGMENT_KEY = "pycomm/shm/segment"
_SAME_HOST_GROUPS: dict[str, dist.ProcessGroup | None] = {}
_RANKS_BY_HOST: dict[str, list[tuple[str, str]]] = {}
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_HOST_KEY = "pycomm/shm/host/{}"
_MAPPED_KEY = "pycomm/shm/mapped/{}"


def host_identity() -> str:
    """Hostname plus kernel boot id: equal for processes that can share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _check_one_host(store: dist.Store, rank: int, size: int) -> None:
    mine = host_identity()
    store.set(_HOST_KEY.format(rank), mine)
    hosts = [store.get(_HOST_KEY.format(r)).decode() for r in range(size)]
    elsewhere = [r for r, h in enumerate(hosts) if h != mine]
    if elsewhere:
        raise RuntimeError(
            f"pycomm backend: ranks {elsewhere} run on another host than rank {rank} "
            f"({mine}); the shared-memory backend needs every rank of the group on one host "
            "(use gloo across hosts)")


def create_backend(store: dist.Store, rank: int, size: int,
                   timeout: datetime.timedelta) -> _C.ShmBackend:
    """The creator torch calls for each new "pycomm" group (store, rank, size, timeout)."""
    _check_one_host(store, rank, size)
    timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    if rank == 0:
        name = f"/pycomm-{os.getpid()}-{secrets.token_hex(8)}"
        backend = _C.ShmBackend(name, rank, size, timeout_ms, True)
        try:
            store.set(_SEGMENT_KEY, name)
            store.wait([_MAPPED_KEY.format(r) for r in range(1, size)], timeout)
        finally:
            _C.ShmBackend.unlink(name)
        return backend
    name = store.get(_SEGMENT_KEY).decode()
    try:
        backend = _C.ShmBackend(name, rank, size, timeout_ms, False)
    except Exception:
        _C.ShmBackend.unlink(name)
        raise
    store.set(_MAPPED_KEY.format(rank), "1")
    return backend


def register() -> None:
    """Make `dist.init_process_group("pycomm")` available (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, create_backend, devices=["cpu"])


def stats(group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """This rank's counters of a "pycomm" group (default: the world group) since it was
    created, to see how its collectives ran:

    - ``ops_on_caller_thread`` / ``ops_on_worker_thread``: operations run by the thread
      that issued or waited on them (blocking calls, ``work.wait()``) / by the group's
      worker threads (asynchronous calls still queued when nobody waited, e.g. DDP's
      buckets during backward);
    - ``worker_idle_wakeups``: a worker thread woke and found nothing to run (should
      stay near 0: each costs a context switch that may preempt a peer rank);
    - ``waits``: waits for a peer that was not there yet, of which ``waits_spun`` ended
      while spinning and ``waits_slept`` only after sleeping in the kernel;
      ``waits_spun_through_wakeup``: spins prolonged because a peer was being woken;
    - ``spin_budget_ns``: the collectives' current spin budget, learned from the peers'
      arrival times (README, "Waiting").

    For the group pycomm's DDP reduces its gradients on, pass ``ddp.gradient_group``.
    """
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("pycomm.shm.stats: torch.distributed is not initialized")
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ShmBackend):
        raise ValueError(f"pycomm.shm.stats: group {group.group_name!r} uses backend "
                         f"{dist.get_backend(group)!r}, not {BACKEND_NAME!r}")
    return dict(backend.stats())


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def gloo_address() -> str:
    """The address this process's Gloo pairs bind to: GLOO_SOCKET_IFNAME's IPv4 address
    when set, else the one the hostname resolves to (Gloo's own choice); "?" if neither."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    try:
        if ifname:
            import fcntl
            import struct

            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", ifname[:15].encode()))
            return socket.inet_ntoa(packed[20:24])
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


def ranks_by_host(group: dist.ProcessGroup) -> list[tuple[str, str]]:
    """[(address, "hostname: ranks 0, 1")] per host of a Gloo `group` whose ranks span
    hosts (global ranks), [] otherwise: what pycomm's DDP names when a collective fails
    across hosts (Note [Peers in failure messages] in csrc/reducer/finalize.cpp).
    Collective over `group` the first time; cached per group."""
    if group.group_name not in _RANKS_BY_HOST:
        _RANKS_BY_HOST[group.group_name] = _ranks_by_host(group)
    return _RANKS_BY_HOST[group.group_name]


def _ranks_by_host(group: dist.ProcessGroup) -> list[tuple[str, str]]:
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) < 2:
        return []
    where = all_gather_object((host_identity(), gloo_address()), group=group)
    if len({identity for identity, _ in where}) < 2:
        return []
    hosts: dict[tuple[str, str], list[int]] = {}
    for rank, key in zip(dist.get_process_group_ranks(group), where):
        hosts.setdefault(key, []).append(rank)
    return [(address, f"{identity.split('/')[0]}: rank{'s' if len(ranks) > 1 else ''} "
                      f"{', '.join(map(str, ranks))}")
            for (identity, address), ranks in hosts.items()]


def same_host_group(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """A "pycomm" group over the ranks of `group` (a CPU-only Gloo group), or None when
    that would not help: one rank, another backend, or ranks on several hosts. Collective
    over `group` the first time; the answer is cached per group."""
    if group.group_name in _SAME_HOST_GROUPS:
        return _SAME_HOST_GROUPS[group.group_name]
    answer = None
    size = dist.get_world_size(group)
    if dist.get_backend(group) == BACKEND_NAME:
        answer = group
    elif dist.get_backend(group) == "gloo" and size > 1:
        hosts = all_gather_object(host_identity(), group=group)
        if len(set(hosts)) == 1:
            answer = dist.new_group(dist.get_process_group_ranks(group), backend=BACKEND_NAME,
                                    timeout=_group_timeout(group),
                                    use_local_synchronization=True)
    _SAME_HOST_GROUPS[group.group_name] = answer
    return answer
