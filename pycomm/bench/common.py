"""What every benchmark shares: getting ranks (local spawn or torchrun's env://) and the
header lines. Benchmarks themselves are `run(config) -> result` on an initialized group;
`launch` hands rank 0's result back to the caller."""

from __future__ import annotations

import datetime
import os
import pickle
import platform
import tempfile
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._version import __version__

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Ranks fork from a server that has imported torch once: several seconds cheaper per run
# than `spawn` on a small machine, and as clean (no parent threads or CUDA state).
_START_METHOD = "forkserver"
_RESULT_FILE = "rank0.pkl"


def under_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def default_backend(nproc: int = 1) -> str:
    """NCCL when there is a GPU for every rank, else Gloo."""
    return "nccl" if torch.cuda.device_count() >= max(nproc, 1) else "gloo"


def device_of(backend: str) -> torch.device:
    """The device a rank's buffers live on: its GPU under NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_ARRIVED, _ALL_ARRIVED = "pycomm/leave/arrived", "pycomm/leave/all_arrived"
_LEFT, _ALL_LEFT = "pycomm/leave/left", "pycomm/leave/all_left"


def _arrive(store: dist.Store, world_size: int) -> None:
    if store.add(_ARRIVED, 1) == world_size:
        store.set(_ALL_ARRIVED, "1")


def _depart(store: dist.Store, world_size: int) -> None:  # every rank but 0
    if store.add(_LEFT, 1) == world_size - 1:
        store.set(_ALL_LEFT, "1")


def leave_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Destroy the default process group once every rank has finished its collectives.

    Destroying a group closes its Gloo connections, and a connection closed while its peer
    still works on the group's last collective can take what that peer was owed with it
    (a reset discards bytes not yet read). A 3-rank test waited out its 60 s Gloo timeout
    on such a recv in about 1 run of the whole suite in 10 on a loaded machine, never in
    300 runs of the test alone: the cause is inferred, and this removes the one ordering
    the launchers left to chance. The ranks meet in the store first, which carries no
    collective, and rank 0 leaves last: its store may be the server the others meet in. A
    rank that exits on purpose without its group calls `abandon_group` instead."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size > 1:
        _arrive(store, world_size)
        store.wait([_ALL_ARRIVED], timeout)
    dist.destroy_process_group()
    if world_size > 1:
        if rank == 0:
            store.wait([_ALL_LEFT], timeout)
        else:
            _depart(store, world_size)


def abandon_group(store: dist.Store, rank: int, world_size: int) -> None:
    """Count this rank as arrived and gone at `leave_group`'s meeting, for a rank about to
    exit without its group (a test's simulated crash), so that the others do not wait
    for it there."""
    if world_size > 1:
        _arrive(store, world_size)
        if rank != 0:
            _depart(store, world_size)


def _rank_entry(rank: int, body: Callable, nproc: int, backend: str, tmp: str,
                timeout_s: float, threads: Optional[int], args: Any) -> None:
    if threads:
        torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(tmp, "store"), nproc)
    _init(backend, timeout_s, rank=rank, world_size=nproc, store=store)
    result = body(args)
    leave_group(store, rank, nproc, timeout_s)
    if rank == 0:
        with open(os.path.join(tmp, _RESULT_FILE), "wb") as f:
            pickle.dump(result, f)


def _init(backend: str, timeout_s: float, **kw: Any) -> None:
    if backend == "nccl":
        # one GPU per rank, given to the group too (device_id): without it the group's
        # barrier() guesses the device and warns
        device = kw.get("rank", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        kw["device_id"] = torch.device("cuda", device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)


def launch(body: Callable[[Any], Any], args: Any, nproc: int, backend: str,
           timeout_s: float = 300.0, threads: Optional[int] = 1) -> Any:
    """Run module-level `body(args)` on every rank and return rank 0's result: under
    torchrun in this process, else on `nproc` local ranks rendezvoused through a FileStore
    in a temp dir. `threads` sets torch's intra-op threads per rank (None: torch's default;
    1 by default, so that local ranks do not fight over the cores)."""
    if under_torchrun():
        if threads:
            torch.set_num_threads(threads)
        _init(backend, timeout_s)
        result = body(args)
        dist.destroy_process_group()
        return result
    ctx = mp.get_context(_START_METHOD)
    ctx.set_forkserver_preload(["torch", "torch.distributed", body.__module__])
    with tempfile.TemporaryDirectory(prefix="pycomm-bench-") as tmp:
        mp.start_processes(_rank_entry, nprocs=nproc, start_method=_START_METHOD,
                           args=(body, nproc, backend, tmp, timeout_s, threads, args))
        with open(os.path.join(tmp, _RESULT_FILE), "rb") as f:
            return pickle.load(f)


# Note [Steady allocator]
# glibc's malloc serves a block above its mmap threshold with a fresh mapping and returns
# it to the kernel when freed; the threshold moves up as such blocks are freed, and the
# heap is trimmed back to the kernel past a trim threshold. A training step that frees
# and reallocates its gradients (zero_grad sets them to None) therefore page-faults over
# them in some processes and reuses warm heap pages in others, depending on allocation
# history alone. Measured (benchmark MLP, 6 x 16 MiB gradients, 2 ranks): the no_sync
# backward of one wrapper took 54 ms in one rank and 88 ms in the other, with the same
# difference in CPU time, and which wrapper and rank drew the slow case changed from run
# to run. Fixing the threshold at 32 MiB (the most glibc allows on 64-bit) and trimming
# only past 2 GiB (mallopt takes an int) makes every rank and every wrapper allocate the
# same way: the spread vanished (96-105 ms of CPU everywhere). Six 16 MiB blocks
# allocated, written and freed six times fault 24.6k, 24.6k, 20.5k, 8.2k, 0, 0 pages by
# default (some runs 24.6k, 24.6k, 24.6k, 24.5k, 8.2k, 0) and 24.6k, 4.1k, 0, 0, 0, 0
# so; how much the second cycle faults varies from run to run (4.1k to 24.6k in
# 2026-11-25's runs, the third 0 to 8.2k), but from the fourth on nothing faults
# (tests/bench/test_ddp.py); the benchmarks' warm-up steps cover the first cycles.
# Benchmarks that compare step times call this before building their models.


def steady_allocator() -> str:
    """Fix glibc's mmap threshold at 32 MiB and its trim threshold at 2 GiB in this
    process (See Note [Steady allocator]); what was done, for the header."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return "malloc as is (no glibc mallopt)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, 32 << 20) == 1 and mallopt(m_trim_threshold, 2**31 - 1) == 1
    return "malloc mmap threshold 32 MiB, trim 2 GiB" if ok else "malloc as is (mallopt refused)"


def device_name(backend: str) -> str:
    if backend == "nccl":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def header(title: str, **fields: Any) -> str:
    meta = " | ".join(f"{k} {v}" for k, v in fields.items())
    return (f"# pycomm {__version__} | torch {torch.__version__} | backend {dist.get_backend()}"
            f" | world {dist.get_world_size()} | {device_name(dist.get_backend())}\n"
            f"# {title} | {meta}")
