"""All-reduce latency and bandwidth over a size sweep, in nccl-tests' columns."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import common


@dataclass(frozen=True)
class Config:
    min_bytes: int = 8
    max_bytes: int = 1 << 20
    step_factor: int = 4
    warmup: int = 5
    iters: int = 20


@dataclass(frozen=True)
class Row:
    size: int
    count: int
    time_us: float
    algbw: float
    busbw: float


def _sizes(cfg: Config):
    size = cfg.min_bytes
    while size <= cfg.max_bytes:
        yield size
        size *= cfg.step_factor


def _measure(cfg: Config, size: int, device: torch.device) -> Row:
    n = dist.get_world_size()
    t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    for _ in range(cfg.warmup):
        dist.all_reduce(t)
    _sync(device)
    start = time.perf_counter()
    for _ in range(cfg.iters):
        dist.all_reduce(t)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / cfg.iters], dtype=torch.float64)
    dist.all_reduce(elapsed.to(device), op=dist.ReduceOp.MAX)
    sec = elapsed.item()
    algbw = t.numel() * 4 / sec / 1e9
    return Row(t.numel() * 4, t.numel(), sec * 1e6, algbw, algbw * 2 * (n - 1) / n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cfg: Config) -> list[Row]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    return [_measure(cfg, size, device) for size in _sizes(cfg)]


def _body(cfg: Config) -> None:
    rows = run(cfg)
    if dist.get_rank() != 0:
        return
    print(common.header("all_reduce", warmup=cfg.warmup, iters=cfg.iters, ranks="max"))
    print(f"#{'size':>11} {'count':>12} {'type':>6} {'redop':>6} {'time':>9} {'algbw':>7} "
          f"{'busbw':>7}")
    print(f"#{'(B)':>11} {'(elements)':>12} {'':>6} {'':>6} {'(us)':>9} {'(GB/s)':>7} "
          f"{'(GB/s)':>7}")
    for r in rows:
        print(f"{r.size:>12} {r.count:>12} {'float':>6} {'sum':>6} {r.time_us:>9.1f} "
              f"{r.algbw:>7.3f} {r.busbw:>7.3f}")
    print(f"# Avg bus bandwidth : {sum(r.busbw for r in rows) / len(rows):.3f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--backend", default=None, help="torch.distributed backend (default: "
                   "nccl with GPUs, else gloo)")


def main(ns: argparse.Namespace) -> int:
    common.launch(_body, Config(), ns.nproc, ns.backend or common.default_backend())
    return 0
