"""pycomm.clip_grad_norm_ against torch's clip_grad_norm_ on FSDP2 gradients (DTensors),
by the number of parameters: a model of N/2 `Linear(16, 16)` layers (a weight and a bias
each), every layer `fully_shard`ed, one backward, then the clip timed on the same
gradients. 2 local Gloo ranks, 1 thread each, CPU. Each timed call starts from the same
gradients (restored, untimed, before it) with `max_norm` below their norm, so every call
scales; the clips alternate call by call (the order rotated each repetition) and the
figure is the median of the slower rank's wall time. Each size runs in fresh processes,
and each clip's first call there is recorded on its own (`first_call_s`): torch's first
call propagates DTensor shardings and costs seconds where later ones cost milliseconds.
torch's clip is timed up to `--torch-max-params` (its first call grows faster than
linearly).

The bound: `floor` is one 2-element float64 all-reduce on the same group plus one
norm and one scale pass over this rank's local shards (pycomm.ops on the list), the work
no clip of these gradients can skip; `local` is that pass alone.

    python benchmarks/fsdp2_clip.py [--params 200,2000,20000] [--reps 9]
        [--torch-max-params 2000] [--torch-reps 3] [--json PATH]

Recorded: benchmarks/results/fsdp2_clip_cpu.md (its .json beside it), made with
    python benchmarks/fsdp2_clip.py --json benchmarks/results/fsdp2_clip_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pycomm
from pycomm import ops


def _model(n_params: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(n_params // 2)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's
    return elapsed.item()


def _measure(n: int, rank: int, args: argparse.Namespace) -> dict:
    model = _model(n)
    params = list(model.parameters())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    grads = [p.grad for p in params]
    saved = [g.to_local().clone() for g in grads]
    local = [g.to_local() for g in grads]
    norm = torch.nn.utils.get_total_norm(grads).full_tensor().item()
    max_norm = 0.5 * norm
    row_sum = torch.zeros(2, dtype=torch.float64)

    def restore():
        for g, s in zip(local, saved):
            g.copy_(s)

    def floor():
        partial = ops.norm_partial(local, 2.0)
        dist.all_reduce(row_sum)
        ops.scale_(local, partial[:1].clamp(max=1.0))

    impls = {
        "pycomm": lambda: pycomm.clip_grad_norm_(params, max_norm),
        "floor": floor,
        "local": lambda: ops.scale_(local, ops.norm_partial(local, 2.0)[:1].clamp(max=1.0)),
    }
    with_torch = n <= args.torch_max_params
    if with_torch:
        impls["torch"] = lambda: torch.nn.utils.clip_grad_norm_(params, max_norm)
    first = {}
    for name, fn in impls.items():  # the first call of each, in a fresh process
        restore()
        first[name] = _timed(fn)
    times: dict[str, list[float]] = {k: [] for k in impls}
    names = list(impls)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if name == "torch" and len(times["torch"]) >= args.torch_reps:
                continue
            restore()
            times[name].append(_timed(impls[name]))
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"params": n, "layers": n // 2,
           "local_elements_per_rank": sum(t.numel() for t in local),
           "median_s": med, "first_call_s": first,
           "samples": {k: len(v) for k, v in times.items()},
           "pycomm_over_floor": med["pycomm"] / med["floor"]}
    if with_torch:
        row["torch_over_pycomm"] = med["torch"] / med["pycomm"]
        row["first_call_torch_over_pycomm"] = first["torch"] / first["pycomm"]
    return row


def _rank(rank: int, world: int, store_path: str, n: int, args: argparse.Namespace,
          out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    row = _measure(n, rank, args)
    if rank == 0:
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="200,2000,20000",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--torch-max-params", type=int, default=2000)
    parser.add_argument("--torch-reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    for n in args.params:  # fresh processes for each size: each first call is a first call
        with tempfile.TemporaryDirectory(prefix="pycomm-clip-") as tmp:
            out = os.path.join(tmp, "row.json")
            mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), n, args, out),
                               nprocs=2, start_method="spawn")
            with open(out) as f:
                rows.append(json.load(f))
    record = {
        "bench": "fsdp2_clip", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__, "pycomm": pycomm.__version__,
        "host": platform.node(), "cpus": os.cpu_count(), "ranks": 2, "threads_per_rank": 1,
        "backend": "gloo", "load_before": load_before, "load_after": os.getloadavg(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print("params | torch first call | pycomm first call | torch | pycomm | floor | local | "
          "torch/pycomm first, later (ms, medians)")
    for row in rows:
        med, first = row["median_s"], row["first_call_s"]
        t = "torch" in med
        print(f"{row['params']} | {first['torch'] * 1e3 if t else float('nan'):.1f} | "
              f"{first['pycomm'] * 1e3:.3f} | {med['torch'] * 1e3 if t else float('nan'):.2f} | "
              f"{med['pycomm'] * 1e3:.3f} | {med['floor'] * 1e3:.3f} | {med['local'] * 1e3:.3f} | "
              + (f"{row['first_call_torch_over_pycomm']:.0f}x, {row['torch_over_pycomm']:.1f}x"
                 if t else "-"))


if __name__ == "__main__":
    main()
