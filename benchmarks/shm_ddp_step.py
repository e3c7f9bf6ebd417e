"""DDP step time on 2 local CPU ranks: torch's DDP on Gloo, pycomm's DDP with its
gradients on the shared-memory backend (the default on one host), and pycomm's DDP with
that turned off (Gloo), side by side in one run: every repetition times each variant in
turn, and the figure is the median over repetitions of the mean step time (max over
ranks). Interleaving keeps the ratios meaningful on a shared machine.

    python benchmarks/shm_ddp_step.py --json shm_ddp_step.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pycomm


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


def _variants(base: nn.Module, cap: float) -> dict[str, nn.Module]:
    off = pycomm.DDPConfig(bucket_cap_mb=cap, shared_memory_gradients=False)
    return {
        "torch_ddp_gloo": nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                              bucket_cap_mb=cap),
        "pycomm_ddp_shm": pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap),
        "pycomm_ddp_gloo": pycomm.DistributedDataParallel(copy.deepcopy(base), config=off),
    }


def _steps(model: nn.Module, opt, x, y, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    spent = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return spent.item()


def _body(rank: int, nproc: int, store_path: str, ns: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, nproc), rank=rank,
                            world_size=nproc, timeout=datetime.timedelta(seconds=600))
    base = _mlp(ns.width, ns.depth)
    params = sum(p.numel() for p in base.parameters())
    models = _variants(base, ns.bucket_cap_mb)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(ns.batch, ns.width, generator=g), torch.randn(ns.batch, 16, generator=g)
    for k, m in models.items():
        _steps(m, opts[k], x, y, ns.warmup)
    samples: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(ns.reps):
        for k, m in models.items():
            samples[k].append(_steps(m, opts[k], x, y, ns.steps))
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
        for k, v in med.items():
            print(f"{k:>16}: {v:8.1f} ms/step  ({v / med['torch_ddp_gloo']:.3f}x torch DDP)")
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"command": "python benchmarks/shm_ddp_step.py " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(ns).items()
                    if k != "json" and v is not None),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"),
                    "torch": torch.__version__, "pycomm": pycomm.__version__, "world": nproc,
                    "cores": os.cpu_count(), "threads_per_rank": 1, "params": params,
                    "machine_shared": True, "loadavg_1min_end": os.getloadavg()[0],
                    "statistic": "median over reps of mean step time, max over ranks",
                    "ms_per_step": med, "samples_s": samples}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pycomm-shm-ddp-") as tmp:
        mp.start_processes(_body, nprocs=ns.nproc, start_method="spawn",
                           args=(ns.nproc, os.path.join(tmp, "store"), ns))


if __name__ == "__main__":
    main()
