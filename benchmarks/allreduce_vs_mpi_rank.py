"""One rank of benchmarks/allreduce_vs_mpi.py, started by mpirun: the same processes hold
Open MPI (through mpi4py, and through the C floor in mpi_floor.c) and a "pycomm"
torch.distributed group, so every implementation is measured on the same cores, in
blocks that alternate (the order rotates each block). This file measures; the driver
launches, summarises and reports.

Each block times one implementation at one size two ways, both after an MPI barrier:
back to back (`iters` calls, time / iters) and per call (a barrier before each call,
each call timed alone). Times are the slowest rank's (max over ranks; per call index
for the per-call samples). Correctness is checked first, untimed, on data whose sum is
exact in float32; the timed buffers hold zeros (sums stay 0: no overflow, no denormals).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from allreduce_vs_mpi import BREAKDOWN, BREAKDOWN_UP_TO, NOT_ALL_REDUCE
from mpi4py import MPI

import pycomm

_BYTES_PER_BLOCK = 1 << 26  # back-to-back calls per block: about this many bytes reduced
_MAX_ITERS, _MIN_ITERS = 1000, 4


# The back-to-back calls of a block are timed in this many consecutive chunks, with no
# synchronisation between them, and the block's figure is the median chunk: on this shared
# 2-core VM a loop longer than a scheduler slice (a few ms) is stretched by whatever else
# runs (a local t.add_(0) measured 3.6 us per call alone and 11.4 us as the mean of 1,000
# back to back at load 3.5), and the median chunk keeps that out, as the per-call median
# does.
_CHUNKS = 10


def _chunks(iters: int) -> list[int]:
    n = min(_CHUNKS, iters)
    return [iters // n + (1 if i < iters % n else 0) for i in range(n)]


def _iters(size: int) -> tuple[int, int, int]:
    """(warm-up, back-to-back calls, per-call samples) of one block at `size` bytes."""
    iters = max(_MIN_ITERS, min(_MAX_ITERS, _BYTES_PER_BLOCK // size))
    return max(1, min(50, iters // 10)), iters, max(3, min(1000, iters // 4))


class Impl:
    """One way to all-reduce a float32 buffer of `count` elements in place."""

    def __init__(self, name: str, count: int, comm):
        self.name, self.comm = name, comm

    def view(self) -> np.ndarray:
        """The buffer as a numpy array (shared memory, not a copy)."""
        raise NotImplementedError

    def call(self) -> None:
        raise NotImplementedError

    def back_to_back(self, iters: int) -> float:
        """Seconds per call of `iters` calls after a barrier (See _CHUNKS)."""
        self.comm.Barrier()
        return float(np.median([self.loop(n) for n in _chunks(iters)]))

    def loop(self, iters: int) -> float:
        call, start = self.call, time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - start) / iters

    def per_call(self, samples: int) -> np.ndarray:
        out = np.empty(samples)
        barrier, call, clock = self.comm.Barrier, self.call, time.perf_counter
        for i in range(samples):
            barrier()
            start = clock()
            call()
            out[i] = clock() - start
        return out


class Mpi4py(Impl):
    def __init__(self, name, count, comm):
        super().__init__(name, count, comm)
        self.a = np.zeros(count, dtype=np.float32)
        self.call = functools.partial(comm.Allreduce, MPI.IN_PLACE, self.a)

    def view(self):
        return self.a


class MpiFloor(Mpi4py):
    """MPI_Allreduce called and timed in C (mpi_floor.c)."""

    def __init__(self, name, count, comm, lib):
        super().__init__(name, count, comm)
        self.lib, self.count = lib, count
        self.ptr = self.a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def loop(self, iters):
        return self.lib.floor_back_to_back(self.ptr, self.count, iters)

    def per_call(self, samples):
        out = np.empty(samples)
        self.lib.floor_per_call(self.ptr, self.count, samples,
                                out.ctypes.data_as(ctypes.POINTER(ctypes.c_double)))
        return out


class Torch(Impl):
    """A pycomm (or torch) call on a tensor, given as a function of the tensor."""

    def __init__(self, name, count, comm, make_call):
        super().__init__(name, count, comm)
        self.t = torch.zeros(count)
        self.call = make_call(self.t)

    def view(self):
        return self.t.numpy()


def _load_floor(path: str | None):
    if not path:
        return None
    lib = ctypes.CDLL(path)
    lib.floor_back_to_back.restype = ctypes.c_double
    lib.floor_back_to_back.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int,
                                       ctypes.c_int]
    lib.floor_per_call.restype = None
    lib.floor_per_call.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int,
                                   ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    return lib


def _makers(comm, floor) -> dict:
    """name -> f(count) -> Impl, for what this process can run."""
    world = dist.group.WORLD
    backend = world._get_backend(torch.device("cpu"))
    solo = dist.new_subgroups(group_size=1)[0]
    opts = dist.AllreduceOptions()
    opts.reduceOp, opts.asyncOp = dist.ReduceOp.SUM, False

    def torch_impl(name, make_call):
        return lambda count: Torch(name, count, comm, make_call)

    makers = {
        "ompi-mpi4py": lambda count: Mpi4py("ompi-mpi4py", count, comm),
        "pycomm": torch_impl("pycomm", lambda t: functools.partial(dist.all_reduce, t)),
        "pycomm-pg": torch_impl("pycomm-pg", lambda t: lambda: world.allreduce([t], opts).wait()),
        "pycomm-backend": torch_impl(
            "pycomm-backend", lambda t: lambda: backend.allreduce([t], opts).wait()),
        "pycomm-inline": torch_impl("pycomm-inline", lambda t: functools.partial(
            backend.allreduce_inline, t, dist.ReduceOp.SUM)),
        "pycomm-solo": torch_impl(
            "pycomm-solo", lambda t: functools.partial(dist.all_reduce, t, group=solo)),
        "torch-op": torch_impl("torch-op", lambda t: functools.partial(t.add_, 0)),
    }
    if floor is not None:
        makers["ompi-c"] = lambda count: MpiFloor("ompi-c", count, comm, floor)
    if hasattr(pycomm.shm, "all_reduce"):
        makers["pycomm-direct"] = torch_impl(
            "pycomm-direct", lambda t: functools.partial(pycomm.shm.all_reduce, t))
    return makers


def _wrong(impl: Impl, count: int, rank: int, world: int) -> int:
    """Mismatches of one all-reduce on small integers (exact in float32); -1 for a layer
    that is not an all-reduce."""
    if impl.name in NOT_ALL_REDUCE:
        return -1
    pattern = np.arange(count, dtype=np.float32) % 7
    impl.view()[:] = pattern + (rank + 1)
    impl.call()
    expect = pattern * world + world * (world + 1) / 2
    wrong = int(np.count_nonzero(impl.view() != expect))
    impl.view()[:] = 0
    return wrong


def _max_over_ranks(comm, values: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    comm.Allreduce(values, out, op=MPI.MAX)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", required=True, help="comma-separated bytes")
    ap.add_argument("--impls", required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--floor", default=None, help="the built mpi_floor shared library")
    ns = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    dist.init_process_group("pycomm", store=dist.FileStore(ns.store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    makers = _makers(comm, _load_floor(ns.floor))
    names = [n for n in ns.impls.split(",") if n in makers]
    sizes = [int(s) for s in ns.sizes.split(",")]
    blocks = {(n, s): makers[n](s // 4) for s in sizes for n in names
              if n not in BREAKDOWN or s <= BREAKDOWN_UP_TO}
    rows = {key: {"impl": key[0], "size": key[1], "b2b_s": [], "call_p50_s": [],
                  "call_p90_s": [], "wrong": _wrong(impl, key[1] // 4, rank, world)}
            for key, impl in blocks.items()}
    loads = [os.getloadavg()]
    for rep in range(ns.reps):
        for i, size in enumerate(sizes):
            here = [n for n in names if (n, size) in blocks]
            shift = (rep + i) % len(here)
            for name in here[shift:] + here[:shift]:
                impl, row = blocks[(name, size)], rows[(name, size)]
                warmup, iters, samples = _iters(size)
                for _ in range(warmup):
                    impl.call()
                b2b = _max_over_ranks(comm, np.array([impl.back_to_back(iters)]))[0]
                calls = _max_over_ranks(comm, impl.per_call(samples))
                row["b2b_s"].append(float(b2b))
                row["call_p50_s"].append(float(np.median(calls)))
                row["call_p90_s"].append(float(np.percentile(calls, 90)))
        loads.append(os.getloadavg())
    wrong = {key: int(v) for key, v in zip(rows, _max_over_ranks(
        comm, np.array([r["wrong"] for r in rows.values()], dtype=np.float64)))}
    for key, row in rows.items():
        row["wrong"] = None if wrong[key] < 0 else wrong[key]
        row["iters"], row["samples"] = _iters(key[1])[1:]
    # How pycomm's waits ended over the whole run, per rank: under load, waits that slept
    # (a futex wake-up costs 60-250 us on this VM) are what stretches its times.
    stats = comm.gather(pycomm.shm.stats(), root=0)
    if rank == 0:
        with open(ns.out, "w") as f:
            json.dump({"world": world, "impls": names, "mpi_library": MPI.Get_library_version()
                       .splitlines()[0].strip(" \x00"), "torch": torch.__version__,
                       "pycomm": pycomm.__version__, "loadavg_per_rep": loads,
                       "pycomm_stats_per_rank": stats, "rows": list(rows.values())}, f,
                      indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
