"""DDP step time, pycomm vs torch, side by side: the same model and data trained by both in
one run, interleaved, medians; exposed communication = step time - the same step in no_sync."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..ddp import DistributedDataParallel as PycommDDP
from . import bucket_sweep, common

MODELS = ("mlp", "transformer")
IMPLS = {"torch": TorchDDP, "pycomm": PycommDDP}


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = MODELS
    bucket_cap_mb: float = 25.0
    warmup: int = 3
    reps: int = 5
    steps: int = 4
    threads: int = 1


@dataclass(frozen=True)
class Result:
    model: str
    params: int
    impl: str
    step_ms: float          # median over ranks' max: zero_grad + forward + backward + SGD step
    backward_ms: float      # median: loss.backward() call, reducer finalize included
    no_sync_step_ms: float  # the same step inside no_sync() (no communication)
    exposed_ms: float       # step_ms - no_sync_step_ms


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":  # 6 x (2048 x 2048) ~ 25.2M parameters
        layers = [m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.ReLU())]
        return nn.Sequential(*layers), torch.randn(32, 2048)
    if name == "transformer":  # 8 encoder layers, d_model 512, ff 2048 ~ 25.2M parameters
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 8, enable_nested_tensor=False), torch.randn(4, 64, 512)
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def _step(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    opt.zero_grad()
    loss = ddp(x).float().square().mean()
    bwd = time.perf_counter()
    loss.backward()
    bwd_end = time.perf_counter()
    opt.step()
    return time.perf_counter() - start, bwd_end - bwd


def _timed(ddp, opt, x, steps: int, no_sync: bool) -> list[tuple[float, float]]:
    out = []
    for _ in range(steps):
        dist.barrier()
        if no_sync:
            with ddp.no_sync():
                out.append(_step(ddp, opt, x))
        else:
            out.append(_step(ddp, opt, x))
    return out


def _rank_max(samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [tuple(r) for r in t.tolist()]


def run_model(cfg: Config, name: str) -> list[Result]:
    module, x = _model(name)
    runs = {}
    for impl, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(module), bucket_cap_mb=cfg.bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
        for _ in range(cfg.warmup):
            _step(ddp, opt, x)
        runs[impl] = (ddp, opt, {False: [], True: []})
    for rep in range(cfg.reps):  # interleaved, alternating who goes first
        order = list(IMPLS) if rep % 2 == 0 else list(reversed(IMPLS))
        for impl in order:
            ddp, opt, samples = runs[impl]
            for no_sync in (False, True):
                samples[no_sync] += _rank_max(_timed(ddp, opt, x, cfg.steps, no_sync))
    params = sum(p.numel() for p in module.parameters())
    results = []
    for impl, (_, _, samples) in runs.items():
        step = statistics.median(s for s, _ in samples[False]) * 1e3
        bwd = statistics.median(b for _, b in samples[False]) * 1e3
        quiet = statistics.median(s for s, _ in samples[True]) * 1e3
        results.append(Result(name, params, impl, step, bwd, quiet, step - quiet))
    return results


def run(cfg: Config) -> list[Result]:
    return [r for name in cfg.models for r in run_model(cfg, name)]


def format_results(cfg: Config, results: list[Result]) -> str:
    lines = [common.header("ddp step time (ms), medians of per-step max over ranks",
                           bucket_cap_mb=cfg.bucket_cap_mb, threads=cfg.threads,
                           warmup=cfg.warmup, reps=cfg.reps, steps=cfg.steps),
             f"#{'model':>11} {'params':>10} {'impl':>7} {'step':>8} {'backward':>9} "
             f"{'no_sync':>8} {'exposed':>8}"]
    for r in results:
        lines.append(f"{r.model:>12} {r.params:>10} {r.impl:>7} {r.step_ms:>8.1f} "
                     f"{r.backward_ms:>9.1f} {r.no_sync_step_ms:>8.1f} {r.exposed_ms:>8.1f}")
    for name in dict.fromkeys(r.model for r in results):
        t, p = (next(r for r in results if r.model == name and r.impl == i) for i in IMPLS)
        lines.append(f"# {name}: pycomm/torch step {p.step_ms / t.step_ms:.3f}, backward "
                     f"{p.backward_ms / t.backward_ms:.3f}, exposed "
                     f"{p.exposed_ms / t.exposed_ms if t.exposed_ms > 0 else float('nan'):.3f}")
    return "\n".join(lines)


def _body(cfg: Config) -> tuple[str, list[Result]]:
    results = run(cfg)
    return format_results(cfg, results), results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--backend", default=None, help="default: nccl with GPUs, else gloo")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    p.add_argument("--bucket-cap-mb", type=float, default=Config.bucket_cap_mb)
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--steps", type=int, default=Config.steps, help="timed steps per rep")
    p.add_argument("--warmup", type=int, default=Config.warmup)
    p.add_argument("--threads", type=int, default=Config.threads, help="compute threads/rank")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    bucket_sweep.add_arguments(p)


def main(ns: argparse.Namespace) -> int:
    if ns.sweep_bucket_cap:
        return bucket_sweep.main(ns)
    cfg = Config(tuple(ns.models.split(",")), ns.bucket_cap_mb, ns.warmup, ns.reps, ns.steps,
                 ns.threads)
    backend = ns.backend or common.default_backend(ns.nproc)
    text, results = common.launch(_body, cfg, ns.nproc, backend, timeout_s=3600.0,
                                  threads=cfg.threads)
    print(text, flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "torch": torch.__version__,
                       "world": ns.nproc, "backend": backend,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    return 0
