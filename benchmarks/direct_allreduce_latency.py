"""The latency of pycomm.shm.all_reduce (the direct call, without torch.distributed's
layers) at a few bytes, on 2 local ranks of a "pycomm" group: per rep, `--chunks` chunks
of `--calls` calls back to back, the median chunk's time per call (a scheduler slice lost
to other work costs one chunk, not the figure); the median over `--reps` reps, rank 0's.
Used to measure what a change to the backend's per-operation path costs, alternating the
builds under test in one session (see benchmarks/results/shm_identity_flight_overhead.md).

    python benchmarks/direct_allreduce_latency.py [--bytes 4] [--reps 7] [--label NAME]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _body(rank: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    import pycomm

    dist.init_process_group("pycomm", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    t = torch.ones(max(1, args.bytes // 4))
    for _ in range(args.calls):  # warm up
        pycomm.shm.all_reduce(t)
    reps = []
    for _ in range(args.reps):
        dist.barrier()
        chunks = []
        for _ in range(args.chunks):
            start = time.perf_counter()
            for _ in range(args.calls):
                pycomm.shm.all_reduce(t)
            chunks.append((time.perf_counter() - start) / args.calls * 1e6)
        reps.append(statistics.median(chunks))
    if rank == 0:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{args.label} direct all_reduce {t.nbytes} B, us per call, per rep: "
              f"{' '.join(f'{r:.3f}' for r in reps)} | median {statistics.median(reps):.3f} "
              f"| load {load}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_body, args=(os.path.join(tmp, "store"), args), nprocs=2)


if __name__ == "__main__":
    main()
