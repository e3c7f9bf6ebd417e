"""DDP step time, pycomm vs torch, side by side: the same model and data trained by both in
one run, interleaved, medians; exposed communication = step time - the same step in no_sync.

Models (each ~25M parameters; the work per rank per step is printed with the figures):
  mlp             6 x Linear(2048, 2048), 32 samples per rank per step
  transformer     8 encoder layers (d_model 512, ff 2048), 4 x 64 = 256 tokens per rank:
                  compute-heavy, ~1 s steps where communication is a few % of the step
  transformer_b1  the same model with 1 x 64 = 64 tokens per rank, the small per-rank batch
                  of data-parallel training where gradient communication matters
Process CPU time per step (all threads, slowest rank) is reported beside wall time: on a
machine whose cores all compute, CPU spent moving bytes lengthens the step one for one."""

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

from ..config import DDPConfig
from ..ddp import DistributedDataParallel as PycommDDP
from . import bucket_sweep, common

MODELS = ("mlp", "transformer", "transformer_b1")
_TRANSFORMER_BATCH = {"transformer": 4, "transformer_b1": 1}
_SEQ = 64
IMPLS = {
    "torch": TorchDDP,
    "pycomm": PycommDDP,
    # pycomm with every bucket's all-reduce on the backward thread (see Note [Inline
    # collectives] in csrc/reducer/reducer.cpp): only with --impls, for comparison.
    "pycomm_inline": lambda m, **kw: PycommDDP(m, config=DDPConfig(inline_collectives=True,
                                                                   **kw)),
}
DEFAULT_IMPLS = ("torch", "pycomm")


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = MODELS
    impls: tuple[str, ...] = DEFAULT_IMPLS
    bucket_cap_mb: float = 25.0
    warmup: int = 3
    reps: int = 5
    steps: int = 4
    threads: int = 1


@dataclass(frozen=True)
class Result:
    model: str
    params: int
    per_rank: str           # the work of one rank per step ("256 tokens", "32 samples")
    impl: str
    step_ms: float          # median over ranks' max: zero_grad + forward + backward + SGD step
    backward_ms: float      # median: loss.backward() call, reducer finalize included
    no_sync_step_ms: float  # the same step inside no_sync() (no communication)
    exposed_ms: float       # step_ms - no_sync_step_ms
    cpu_ms: float           # median process CPU time (all threads) of a step, slowest rank
    no_sync_cpu_ms: float   # the same inside no_sync(): cpu_ms - this = communication's CPU


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":  # 6 x (2048 x 2048) ~ 25.2M parameters
        layers = [m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.ReLU())]
        return nn.Sequential(*layers), torch.randn(32, 2048)
    if name in _TRANSFORMER_BATCH:  # 8 encoder layers, d_model 512, ff 2048 ~ 25.2M params
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        return (nn.TransformerEncoder(layer, 8, enable_nested_tensor=False),
                torch.randn(_TRANSFORMER_BATCH[name], _SEQ, 512))
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def _per_rank(name: str, x: torch.Tensor) -> str:
    if name == "mlp":
        return f"{x.shape[0]} samples"
    return f"{x.shape[0]}x{x.shape[1]}={x.shape[0] * x.shape[1]} tokens"


def _step(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[float, ...]:
    """(wall, backward wall, process CPU) seconds of one training step."""
    cpu = time.process_time()
    start = time.perf_counter()
    opt.zero_grad()
    loss = ddp(x).float().square().mean()
    bwd = time.perf_counter()
    loss.backward()
    bwd_end = time.perf_counter()
    opt.step()
    return time.perf_counter() - start, bwd_end - bwd, time.process_time() - cpu


def _timed(ddp, opt, x, steps: int, no_sync: bool) -> list[tuple[float, ...]]:
    out = []
    for _ in range(steps):
        dist.barrier()
        if no_sync:
            with ddp.no_sync():
                out.append(_step(ddp, opt, x))
        else:
            out.append(_step(ddp, opt, x))
    return out


def _rank_max(samples: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [tuple(r) for r in t.tolist()]


def run_model(cfg: Config, name: str) -> list[Result]:
    module, x = _model(name)
    runs = {}
    for impl in cfg.impls:
        ddp = IMPLS[impl](copy.deepcopy(module), bucket_cap_mb=cfg.bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
        for _ in range(cfg.warmup):
            _step(ddp, opt, x)
        runs[impl] = (ddp, opt, {False: [], True: []})
    for rep in range(cfg.reps):  # interleaved, alternating who goes first
        order = list(cfg.impls) if rep % 2 == 0 else list(reversed(cfg.impls))
        for impl in order:
            ddp, opt, samples = runs[impl]
            for no_sync in (False, True):
                samples[no_sync] += _rank_max(_timed(ddp, opt, x, cfg.steps, no_sync))
    params = sum(p.numel() for p in module.parameters())
    results = []
    for impl, (_, _, samples) in runs.items():
        step, bwd, cpu = (statistics.median(s[i] for s in samples[False]) * 1e3
                          for i in range(3))
        quiet, _, quiet_cpu = (statistics.median(s[i] for s in samples[True]) * 1e3
                               for i in range(3))
        results.append(Result(name, params, _per_rank(name, x), impl, step, bwd, quiet,
                              step - quiet, cpu, quiet_cpu))
    return results


def run(cfg: Config) -> list[Result]:
    return [r for name in cfg.models for r in run_model(cfg, name)]


def format_results(cfg: Config, results: list[Result]) -> str:
    lines = [common.header("ddp step time (ms), medians of per-step max over ranks",
                           bucket_cap_mb=cfg.bucket_cap_mb, threads=cfg.threads,
                           warmup=cfg.warmup, reps=cfg.reps, steps=cfg.steps),
             f"#{'model':>15} {'params':>9} {'per rank/step':>19} {'impl':>13} {'step':>7} "
             f"{'backward':>8} {'no_sync':>7} {'exposed':>7} {'cpu':>7} {'cpu_ns':>7}"]
    for r in results:
        lines.append(f"{r.model:>16} {r.params:>9} {r.per_rank:>19} {r.impl:>13} "
                     f"{r.step_ms:>7.1f} {r.backward_ms:>8.1f} {r.no_sync_step_ms:>7.1f} "
                     f"{r.exposed_ms:>7.1f} {r.cpu_ms:>7.1f} {r.no_sync_cpu_ms:>7.1f}")
    lines.append("# cpu: process CPU ms per step (all threads); cpu_ns: the same in no_sync")
    for name in dict.fromkeys(r.model for r in results):
        rows = {r.impl: r for r in results if r.model == name}
        t = rows.get("torch")
        for impl, p in rows.items():
            if t is None or p is t:
                continue
            exposed = p.exposed_ms / t.exposed_ms if t.exposed_ms > 0 else float("nan")
            lines.append(f"# {name}: {impl}/torch step {p.step_ms / t.step_ms:.3f}, backward "
                         f"{p.backward_ms / t.backward_ms:.3f}, exposed {exposed:.3f}, "
                         f"communication CPU {p.cpu_ms - p.no_sync_cpu_ms:.1f} ms vs "
                         f"{t.cpu_ms - t.no_sync_cpu_ms:.1f} ms")
    return "\n".join(lines)


def _body(cfg: Config) -> tuple[str, list[Result]]:
    results = run(cfg)
    return format_results(cfg, results), results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--backend", default=None, help="default: nccl with GPUs, else gloo")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma list of {tuple(IMPLS)}, timed side by side")
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
    impls = tuple(ns.impls.split(","))
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; expected some of {tuple(IMPLS)}")
    cfg = Config(tuple(ns.models.split(",")), impls, ns.bucket_cap_mb, ns.warmup, ns.reps,
                 ns.steps, ns.threads)
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
