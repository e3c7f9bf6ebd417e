"""The "pycomm" torch.distributed backend: shared-memory collectives between the ranks of
one host, implemented in C++ (csrc/shm/), and the hierarchical all-reduce for groups that
span hosts (shared memory within each host, Gloo across; See Note [Hierarchical
all-reduce] in csrc/shm/hier.h). This module owns its registration, its rendezvous and
the Python face of the direct all-reduce (`all_reduce`); the collectives, waits and Work
objects live in the extension.

Rendezvous goes only through the c10d store torch hands the creator (already prefixed per
group): every rank publishes a host identity (hostname and kernel boot id). The ranks of
one host share a segment: its rank 0 creates it under a random name (owner-only
permissions), publishes the name, waits until every rank of the host has mapped it and
unlinks it at once, so /dev/shm keeps nothing of ours whatever happens later (a killed
rank included). A group over several hosts also builds two Gloo groups from the same
store: across hosts (one rank per host, same local index) and over all its ranks (for
every operation but all-reduce).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import secrets
import socket
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from . import _C
from .objects import all_gather_object

BACKEND_NAME = "pycomm"

_SEGMENT_KEY = "pycomm/shm/segment"
_FAILED = "!failed: "  # _SEGMENT_KEY's value when rank 0 could not create the segment
_SAME_HOST_GROUPS: dict[str, dist.ProcessGroup | None] = {}
_HIER_GROUPS: dict[str, tuple[bool, int, dist.ProcessGroup | None]] = {}
_LAYOUTS: dict[str, HostLayout] = {}
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_HOST_KEY = "pycomm/shm/host/{}"
# id(group) -> its _C.ShmBackend, or None where all_reduce must go through
# torch.distributed; an entry leaves with its group (a plain dict by id: half the lookup
# time of a WeakKeyDictionary, which all_reduce pays on every call).
_INLINE: dict[int, _C.ShmBackend | None] = {}
_UNSEEN = object()
_MAPPED_KEY = "pycomm/shm/mapped/{}"


def host_identity() -> str:
    """Hostname plus kernel boot id: equal for processes that can share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _hosts(store: dist.Store, rank: int, size: int) -> list[str]:
    """Every rank's host identity, exchanged through the creator's store."""
    store.set(_HOST_KEY.format(rank), host_identity())
    return [store.get(_HOST_KEY.format(r)).decode() for r in range(size)]


class HostLayout:
    """Which ranks of a group share which host: `hosts[h]` lists host h's ranks (hosts in
    the order of their first rank, ranks in rank order)."""

    def __init__(self, identities: list[str], addresses: list[str] | None = None):
        order = list(dict.fromkeys(identities))
        self.identities = identities
        self.addresses = addresses  # each rank's Gloo address, where gathered
        self.hosts = [[r for r, ident in enumerate(identities) if ident == h] for h in order]

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    @property
    def uniform(self) -> bool:
        """Every host holds the same number of ranks."""
        return len({len(ranks) for ranks in self.hosts}) == 1

    def describe(self) -> str:
        return "; ".join(f"{self.identities[ranks[0]]}: ranks {ranks}" for ranks in self.hosts)


class ShmSpaceError(RuntimeError):
    """/dev/shm cannot hold a new "pycomm" group's segment (See Note [Reserving the
    segment] in csrc/shm/segment.cpp). Raised on every rank of the group. `space` says
    what was needed and how to grant it; the message adds the other way out."""

    def __init__(self, space: str):
        super().__init__(f"{space}, or use a gloo group")
        self.space = space


def _creation_failed(rank: int, what: str) -> RuntimeError:
    if what.startswith(_C.SHM_NO_SPACE):
        return ShmSpaceError(
            f"pycomm backend: rank {rank}: {what.splitlines()[0]}. Grant /dev/shm more "
            f"space (docker run --shm-size=1g ..., or mount -o remount,size=1g /dev/shm)")
    return RuntimeError(f"pycomm backend: rank {rank}: rank 0 could not create the "
                        f"group's segment: {what}")


def _create_local(store: dist.Store, rank: int, size: int,
                  timeout: datetime.timedelta) -> _C.ShmBackend:
    """A shared-memory backend over `size` ranks of one host (rank 0 creates the segment
    and unlinks it once every rank has mapped it; when it cannot, every rank raises)."""
    timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    if rank == 0:
        name = f"/pycomm-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            backend = _C.ShmBackend(name, rank, size, timeout_ms, True)
        except RuntimeError as e:
            store.set(_SEGMENT_KEY, _FAILED + str(e))  # the others raise it too
            if str(e).startswith(_C.SHM_NO_SPACE):
                raise _creation_failed(rank, str(e)) from None
            raise
        try:
            store.set(_SEGMENT_KEY, name)
            store.wait([_MAPPED_KEY.format(r) for r in range(1, size)], timeout)
        finally:
            _C.ShmBackend.unlink(name)
        return backend
    name = store.get(_SEGMENT_KEY).decode()
    if name.startswith(_FAILED):
        raise _creation_failed(rank, name[len(_FAILED):])
    try:
        backend = _C.ShmBackend(name, rank, size, timeout_ms, False)
    except Exception:
        _C.ShmBackend.unlink(name)
        raise
    store.set(_MAPPED_KEY.format(rank), "1")
    return backend


def _gloo(store: dist.Store, rank: int, size: int,
          timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    # Gloo picks its interface as torch's own Gloo groups do (GLOO_SOCKET_IFNAME, else the
    # address the hostname resolves to).
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@dataclasses.dataclass(frozen=True)
class Options:
    """What a "pycomm" group is made with beyond torch's arguments, fixed for its life:
    ``dist.new_group(backend="pycomm", pg_options=pycomm.shm.Options(wire="bf16"))``, or
    ``dist.init_process_group("pycomm", pg_options=...)``."""

    wire: str | _C.Wire = "fp32"
    """What a reduce-scatter of the group (``reduce_scatter_tensor``, and the coalesced
    form FSDP2's coalescing issues) sends across hosts: "fp32" (the values as they are),
    "bf16" or "int8" (a pycomm.Wire, or its name). Each host's sums of a rank's range cross
    once, encoded, and the rank adds them in float32 (Note [Low-precision wire] in
    csrc/shm/wire_codec.h), so a gradient FSDP2 reduce-scatters is rounded once to the
    wire's precision, its sum formed in float32. It applies to SUM and AVG reduce-scatters
    of float32, bfloat16 and float16 tensors; others (float64, integers, MAX, ...) cross
    as they are. All-reduces and all-gathers always cross as they are: a norm or a loss
    all-reduced on the group keeps its bits. On a group whose ranks share one host nothing
    crosses a host and the option changes nothing (a warning says so). Error feedback needs
    a residual kept per tensor across steps, which a group's collectives have no tensor to
    key by: DDPConfig(wire_error_feedback=True) has it for a DDP's buckets."""

    def __post_init__(self):
        wire = self.wire
        if isinstance(wire, str):
            wire = _C.Wire(wire, False)  # a misspelt name raises here, naming what it takes
        elif not isinstance(wire, _C.Wire):
            raise TypeError(f"pycomm.shm.Options(wire=...) takes a pycomm.Wire or one of "
                            f"'fp32', 'bf16', 'int8', got {type(wire).__name__}")
        _C.HierBackend.check_group_wire(wire)
        object.__setattr__(self, "wire", wire)


def _options(pg_options: object) -> Options:
    if pg_options is None:
        return Options()
    if not isinstance(pg_options, Options):
        raise TypeError(f"a \"pycomm\" group takes pg_options=pycomm.shm.Options(...), got "
                        f"{type(pg_options).__module__}.{type(pg_options).__qualname__}")
    return pg_options


def _create_from_torch(opts, pg_options: object):
    """The creator torch calls for each new "pycomm" group (registered with torch's
    extended API: its options, and the group's pg_options)."""
    return create_backend(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                          pg_options)


def create_backend(store: dist.Store, rank: int, size: int,
                   timeout: datetime.timedelta, pg_options: Options | None = None):
    """The backend of a new "pycomm" group (store, rank, size, timeout, and its
    pycomm.shm.Options): a shared-memory backend when every rank runs on this host, else
    the hierarchical one (See Note [Hierarchical all-reduce] in csrc/shm/hier.h) when every
    host holds the same number of ranks."""
    options = _options(pg_options)
    layout = HostLayout(_hosts(store, rank, size))
    if len(layout.hosts) == 1:
        if not options.wire.exact:
            warnings.warn(f"pycomm group of {size} ranks on one host: nothing crosses a host, "
                          f"so Options(wire={options.wire.name!r}) changes nothing",
                          stacklevel=2)
        return _create_local(store, rank, size, timeout)
    if not layout.uniform:
        raise ValueError(
            f"pycomm backend: rank {rank}: the group's hosts hold different numbers of ranks "
            f"({layout.describe()}); shared memory reaches only ranks of one host and the "
            f"hierarchical all-reduce needs as many ranks on every host (use gloo for this "
            f"group)")
    host = layout.host_of(rank)
    local_rank = layout.hosts[host].index(rank)
    per_host = len(layout.hosts[host])
    local = _create_local(dist.PrefixStore(f"pycomm/host{host}/", store), local_rank,
                          per_host, timeout)
    cross = _gloo(dist.PrefixStore(f"pycomm/cross{local_rank}/", store), host,
                  len(layout.hosts), timeout)
    flat = _gloo(dist.PrefixStore("pycomm/flat/", store), rank, size, timeout)
    return _C.HierBackend(rank, size, host, layout.hosts, local, cross, flat, options.wire)


def register() -> None:
    """Make `dist.init_process_group("pycomm")` available (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create_from_torch, extended_api=True,
                                      devices=["cpu"])


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
      arrival times (docs/shm-backend.md, "Waiting").

    For the group pycomm's DDP reduces its gradients on, pass ``ddp.gradient_group``.
    """
    return dict(_shm_backend("stats", group).stats())


def flight_record(group: dist.ProcessGroup | None = None) -> list[dict]:
    """This rank's last operations (up to 2048) on a "pycomm" group (default: the world
    group), oldest first, each a dict: ``seq`` (the operation number pycomm's errors give
    as "#N"), ``op``, ``bytes``, ``dtype``, for pycomm's DDP buckets ``bucket``, ``step``
    and ``forwards`` (-1, 0, 0 otherwise), ``state`` (queued, started, completed, failed),
    ``queued_ns`` / ``started_ns`` / ``ended_ns`` (wall clock, ns; 0 where not reached) and
    the ``error`` of a failed one. For the group pycomm's DDP reduces its gradients on,
    pass ``ddp.gradient_group``. See Note [Flight recorder] in csrc/shm/flight.cpp.
    """
    return list(_shm_backend("flight_record", group).flight_record())


def dump_flight_record(directory: str, group: dist.ProcessGroup | None = None) -> str:
    """Write this rank's flight record of a "pycomm" group into `directory` (JSON, named
    after the group's segment and the rank, as the backend names the file it writes by
    itself at the group's first failure when $PYCOMM_FLIGHT_RECORD_DIR is set); returns its
    path. `python -m pycomm.flight_record DIRECTORY` merges the ranks' files."""
    backend = _shm_backend("dump_flight_record", group)
    path = os.path.join(directory, backend.flight_record_name())
    backend.dump_flight_record(path)
    return path


def _shm_backend(what: str, group: dist.ProcessGroup | None) -> _C.ShmBackend:
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError(f"pycomm.shm.{what}: torch.distributed is not initialized")
    backend = group._get_backend(torch.device("cpu"))
    if isinstance(backend, _C.HierBackend):  # a group over hosts: its shared-memory part
        backend = backend.local
    if not isinstance(backend, _C.ShmBackend):
        raise ValueError(f"pycomm.shm.{what}: group {group.group_name!r} uses backend "
                         f"{dist.get_backend(group)!r}, not {BACKEND_NAME!r}")
    return backend


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: dist.ProcessGroup | None = None) -> None:
    """``dist.all_reduce(tensor, op, group)`` (blocking, in place; ``op`` one of
    ``dist.ReduceOp.SUM``, ``AVG``, ``MAX``, ``MIN``, ``PRODUCT``) on a "pycomm" group
    without torch.distributed's layers: no Python wrapper, no dispatcher, no Work or
    future. For latency-critical small tensors (up to a few KiB it costs a fraction of
    ``dist.all_reduce``: docs/collectives.md, "A small all-reduce, part by part"). It
    keeps the issue order with the group's other operations, whatever thread issued them,
    and raises what ``dist.all_reduce`` raises; on another backend, or a group spanning hosts, it is
    ``dist.all_reduce`` itself. See Note [Inline all-reduce] in csrc/shm/backend.cpp."""
    if group is None:
        group = dist.group.WORLD
    backend = _INLINE.get(id(group), _UNSEEN)
    if backend is _UNSEEN:
        backend = _inline_backend(group)
    if backend is None:
        dist.all_reduce(tensor, op=op, group=group)
    else:
        backend.allreduce_inline(tensor, op)


def _inline_backend(group: dist.ProcessGroup | None) -> _C.ShmBackend | None:
    if group is None:
        raise RuntimeError("pycomm.shm.all_reduce: torch.distributed is not initialized")
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no CPU backend in this group
        backend = None
    backend = backend if isinstance(backend, _C.ShmBackend) else None
    _INLINE[id(group)] = backend
    weakref.finalize(group, _INLINE.pop, id(group), None)
    return backend


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def host_layout(group: dist.ProcessGroup) -> HostLayout:
    """Which ranks of `group` share a host. Collective over `group` the first time; cached
    per group."""
    if group.group_name not in _LAYOUTS:
        where = all_gather_object((host_identity(), gloo_address()), group=group)
        _LAYOUTS[group.group_name] = HostLayout([i for i, _ in where], [a for _, a in where])
    return _LAYOUTS[group.group_name]


# Note [Groups made by their members only]
# same_host_group and hierarchical_group make their "pycomm" group with new_group(...,
# use_local_synchronization=True), called only by the ranks of the group they are given.
# torch names a group from per-process state that such a call moves on its members alone:
# torch 2.13 salts the name of a member-made group with the number of groups the process
# holds; torch 2.15 salts it with its count of groups made, and advances that count, which
# also names every group made by all ranks ("3"). After a group made by some ranks, the next
# group made by others (on 2.15 any group, the world's included) is named one way on the
# former and another way on the latter; each side then waits in the store under its own
# prefix for peers that never come, until the store's timeout (300 s for a FileStore).
# So pycomm names such a group itself, after the group it is made over (a name every member
# shares, unique among live groups), and torch's naming state stays as the other ranks
# have it.
def _pycomm_group_over(group: dist.ProcessGroup) -> dist.ProcessGroup:
    name = f"pycomm_{group.group_name}"
    naming = _c10d._process_group_name
    _c10d._process_group_name = lambda ranks, use_hashed_name: name
    try:
        return dist.new_group(dist.get_process_group_ranks(group), backend=BACKEND_NAME,
                              timeout=_group_timeout(group), use_local_synchronization=True)
    finally:
        _c10d._process_group_name = naming


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
    Collective over `group` the first time (host_layout); cached per group."""
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) < 2:
        return []
    layout = host_layout(group)  # the one gather per group, shared with same_host_group
    if len(layout.hosts) < 2:
        return []
    where = list(zip(layout.identities, layout.addresses))
    hosts: dict[tuple[str, str], list[int]] = {}
    for rank, key in zip(dist.get_process_group_ranks(group), where):
        hosts.setdefault(key, []).append(rank)
    return [(address, f"{identity.split('/')[0]}: rank{'s' if len(ranks) > 1 else ''} "
                      f"{', '.join(map(str, ranks))}")
            for (identity, address), ranks in hosts.items()]


def same_host_group(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """A "pycomm" group over the ranks of `group` (a CPU-only Gloo group), or None when
    that would not help: one rank, another backend, or ranks on several hosts; or when
    /dev/shm cannot hold its segment (every rank then warns once, naming the space needed,
    and stays on `group`). Collective over `group` the first time; the answer is cached
    per group."""
    if group.group_name in _SAME_HOST_GROUPS:
        return _SAME_HOST_GROUPS[group.group_name]
    answer = None
    size = dist.get_world_size(group)
    if dist.get_backend(group) == BACKEND_NAME:
        answer = group
    elif (dist.get_backend(group) == "gloo" and size > 1
          and len(host_layout(group).hosts) == 1):
        try:
            answer = _pycomm_group_over(group)
        except ShmSpaceError as e:  # raised on every rank: all fall back alike
            warnings.warn(f"{e.space}; until then this group's gradients stay on gloo",
                          stacklevel=3)
    _SAME_HOST_GROUPS[group.group_name] = answer
    return answer


def hierarchical_group(group: dist.ProcessGroup,
                       one_rank_per_host: bool = False) -> dist.ProcessGroup | None:
    """A hierarchical "pycomm" group over the ranks of `group` (a CPU-only Gloo group
    spanning several hosts, each holding the same number of ranks, more than one), or None
    when it would not help: one host (see same_host_group), one rank per host (the flat
    Gloo all-reduce is already the cross-host one; `one_rank_per_host` asks for the group
    then too, for what only it does: a low-precision wire, DDPConfig.wire), hosts holding
    different numbers of ranks. See Note [Hierarchical all-reduce] in csrc/shm/hier.h.
    Collective over `group` the first time; the answer is cached per group."""
    # per group: (whether a hierarchy is possible, ranks per host, the group once made)
    if group.group_name not in _HIER_GROUPS:
        possible, per_host = False, 0
        if dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1:
            layout = host_layout(group)
            possible = len(layout.hosts) > 1 and layout.uniform
            per_host = len(layout.hosts[0])
        _HIER_GROUPS[group.group_name] = (possible, per_host, None)
    possible, per_host, made = _HIER_GROUPS[group.group_name]
    if made is None and possible and (per_host > 1 or one_rank_per_host):
        made = _pycomm_group_over(group)
        _HIER_GROUPS[group.group_name] = (possible, per_host, made)
    return made if per_host > 1 or one_rank_per_host else None


def hierarchy(group: dist.ProcessGroup | None = None) -> dict[str, int] | None:
    """How a "pycomm" group reduces: for a group spanning hosts, this rank's ``host``, the
    number of ``hosts``, its ``local_rank`` and the ``ranks_per_host``; None for a group on
    one host (plain shared memory)."""
    group = group if group is not None else dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.HierBackend):
        return None
    return {"host": backend.host, "hosts": backend.hosts,
            "local_rank": backend.local.rank(), "ranks_per_host": backend.local.size()}
