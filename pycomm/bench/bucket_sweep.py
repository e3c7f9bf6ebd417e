"""`pycomm-bench ddp --sweep-bucket-cap`: step time, exposed communication and overlap per
bucket cap, the cap to use, and a picture of one step with torch-sized buckets next to one
with the recommended cap.

Caps run side by side (round-robin, each over its own copy of the same model, seeded
alike), so a noisy machine slows them all alike; each figure is the median over steps of
the slowest rank, and the recommendation follows Note [Bucket-cap recommendation] in
pycomm/overlap/advice.py. A median step of torch's layout is also replayed at every cap
(pycomm/overlap/replay.py) through the network as those steps saw it, so the model's
prediction sits beside each measurement (out of sample for every other cap).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..overlap import (
    AlphaBeta,
    Prediction,
    Sample,
    StepReport,
    fit_alpha_beta,
    fit_in_backward,
    load_collectives_json,
    param_nbytes_from,
    replay,
)
from ..overlap.advice import (
    TORCH_CAP_MB,
    CapResult,
    SweepResult,
    format_sweep,
    paired,
    recommend,
    round_medians,
)
from . import common
from .models import build_model

MIB = 1 << 20


@dataclass(frozen=True)
class SweepConfig:
    caps_mb: tuple[float, ...] = (1.0, 4.0, 25.0, 100.0)
    rounds: int = 4
    steps: int = 3  # per cap per round
    warmup: int = 2
    threads: int = 1  # compute threads per rank
    network: Optional[AlphaBeta] = None  # None: fitted by a quick all-reduce sweep


def fit_network(sizes: Sequence[int] = tuple(4 << (2 * k) for k in range(2, 12)),
                iters: int = 3) -> AlphaBeta:
    """Fit this group's all-reduce (median of `iters` timed calls per size, slowest rank)."""
    samples = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        samples.append(Sample(nbytes, worst.item(), dist.get_world_size()))
    return fit_alpha_beta(samples)


def _slowest(values: Sequence[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _median_step(reports: Sequence[StepReport]) -> StepReport:
    return sorted(reports, key=lambda r: r.backward_s)[len(reports) // 2]


class _Trainer:
    """One cap's copy of the model (same seed as every other cap), wrapped and trained."""

    def __init__(self, cap_mb: float, make_model: Callable[[], nn.Module],
                 loss_of: Callable[[nn.Module], torch.Tensor]):
        from .. import DistributedDataParallel

        torch.manual_seed(0)
        self.ddp = DistributedDataParallel(
            make_model(), bucket_cap_mb=None if cap_mb == TORCH_CAP_MB else cap_mb)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        self.loss_of = loss_of

    def step(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad()
        self.loss_of(self.ddp).backward()
        self.opt.step()
        return time.perf_counter() - start

    def param_nbytes(self, step: StepReport) -> list[int]:
        params = dict(self.ddp.module.named_parameters())
        return param_nbytes_from(step, [params[n].numel() for n in step.timeline["param_names"]])


def _measure(cfg: SweepConfig, trainers: dict[float, _Trainer]
             ) -> dict[float, tuple[list[float], list[StepReport]]]:
    out: dict[float, tuple[list[float], list[StepReport]]] = {cap: ([], []) for cap in trainers}
    for t in trainers.values():
        for _ in range(cfg.warmup):
            t.step()
    for _ in range(cfg.rounds):
        for cap, t in trainers.items():
            times, reports = out[cap]
            times += [t.step() for _ in range(cfg.steps)]
            reports += t.ddp.step_reports(cfg.steps)
    return out


def _layout(step: StepReport) -> tuple:
    return tuple(tuple(sorted(b.params)) for b in step.buckets)


def _row(cfg: SweepConfig, cap: float, measured: dict, torch_rounds: list[float],
         prediction: Prediction, same_as: Optional[float]) -> CapResult:
    times, reports = measured[cap]
    steps = _slowest(times)
    bwd = _slowest([r.backward_s for r in reports])
    comm = _slowest([r.comm_s for r in reports])
    exposed = _slowest([r.exposed_comm_s for r in reports])
    overlap = [1.0 - e / c if c > 0 else 1.0 for e, c in zip(exposed, comm)]
    vs_torch, wins = paired(round_medians(steps, cfg.rounds), torch_rounds)
    med = statistics.median
    return CapResult(cap, len(reports[-1].buckets), med(steps), med(bwd), med(comm), med(exposed),
                     med(overlap), vs_torch, wins, prediction.backward_s,
                     prediction.exposed_comm_s, same_as)


def _predict(cap: float, torch_step: StepReport, network: AlphaBeta, nbytes: list[int]
             ) -> Prediction:
    return replay(torch_step, network, dist.get_world_size(), cap_bytes=int(cap * MIB),
                  first_cap_bytes=MIB if cap == TORCH_CAP_MB else None, param_nbytes=nbytes)


def _in_backward(reports: list[StepReport], idle: AlphaBeta) -> Optional[AlphaBeta]:
    try:
        return fit_in_backward(reports, dist.get_world_size(), idle.alpha_s, idle.latency)
    except ValueError:  # collectives faster than the idle latency: keep the idle network
        return None


def run(cfg: SweepConfig, make_model: Callable[[], nn.Module],
        loss_of: Callable[[nn.Module], torch.Tensor]) -> tuple[SweepResult, dict]:
    """Measure every cap on an initialized group. `make_model()` builds the model (seeded
    alike for every cap), `loss_of(wrapped)` runs a forward on this rank's batch and returns
    the loss. Returns the result and, per cap, this rank's median step (for pictures)."""
    network = cfg.network or fit_network()
    caps = sorted(set(cfg.caps_mb) | {TORCH_CAP_MB})
    trainers = {cap: _Trainer(cap, make_model, loss_of) for cap in caps}
    measured = _measure(cfg, trainers)
    torch_reports = measured[TORCH_CAP_MB][1]
    torch_step = _median_step(torch_reports)
    nbytes = trainers[TORCH_CAP_MB].param_nbytes(torch_step)
    in_backward = _in_backward(torch_reports, network)
    torch_rounds = round_medians(_slowest(measured[TORCH_CAP_MB][0]), cfg.rounds)
    layouts: dict[tuple, float] = {}
    rows = []
    for cap in caps:
        same_as = layouts.setdefault(_layout(measured[cap][1][-1]), cap)
        rows.append(_row(cfg, cap, measured, torch_rounds,
                         _predict(cap, torch_step, in_backward or network, nbytes),
                         same_as if same_as != cap else None))
    best, reason = recommend(rows, cfg.rounds)
    result = SweepResult(dist.get_world_size(), cfg.rounds, network, in_backward, tuple(rows),
                         best, reason)
    return result, {cap: _median_step(measured[cap][1]) for cap in caps}


def draw(path: str, result: SweepResult, steps: dict) -> str:
    """The picture: one step with torch's layout above one with the recommended cap (or,
    when torch's layout is the recommendation, the runner-up). Returns a line to print."""
    from ..overlap.plot import plot_timelines

    others = sorted((r for r in result.rows if r.cap_mb != TORCH_CAP_MB),
                    key=lambda r: r.vs_torch)
    pick = result.recommended_mb if result.recommended_mb != TORCH_CAP_MB else others[0].cap_mb
    label = "recommended" if pick == result.recommended_mb else "runner-up"
    try:
        plot_timelines([("torch's layout (1 MiB first bucket, then 25 MiB)", steps[TORCH_CAP_MB]),
                        (f"{label} {pick:g} MiB", steps[pick])], path)
    except RuntimeError as e:  # matplotlib missing: the table stands on its own
        return f"# no picture: {e}"
    return f"# timeline picture: {path}"


def _body(args: tuple) -> tuple[str, SweepResult, dict]:
    cfg, model_name = args
    allocator = common.steady_allocator()  # before any model exists
    module, x = build_model(model_name)
    result, steps = run(cfg, lambda: copy.deepcopy(module),
                        lambda ddp: ddp(x).float().square().mean())
    title = common.header(f"ddp --sweep-bucket-cap | model {model_name}", warmup=cfg.warmup,
                          rounds=cfg.rounds, steps=cfg.steps, threads=cfg.threads,
                          ranks="slowest", allocator=allocator)
    return title, result, steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's flags, added to `pycomm-bench ddp` (which owns --models, --reps, --steps,
    --warmup, --threads, --nproc, --backend and --json, used here too)."""
    p.add_argument("--sweep-bucket-cap", action="store_true",
                   help="measure step time, exposed communication and overlap per bucket cap "
                   "and recommend one (with a timeline picture)")
    p.add_argument("--caps", type=lambda s: tuple(float(c) for c in s.split(",")),
                   default=SweepConfig.caps_mb, help="bucket caps to sweep, MiB, comma-separated "
                   f"(default {','.join(f'{c:g}' for c in SweepConfig.caps_mb)}; "
                   f"{TORCH_CAP_MB:g}, torch's layout, is always included)")
    p.add_argument("--plot", default="bucket_sweep.png", help="timeline picture (PNG); a model "
                   "name is added when several models are swept; '' for none")
    p.add_argument("--network", metavar="JSON", default=None, help="fit the idle network "
                   "from a `pycomm-bench collectives --json` file instead of a quick sweep")


def config_from(ns: argparse.Namespace) -> SweepConfig:
    network = fit_alpha_beta(load_collectives_json(ns.network)) if ns.network else None
    return SweepConfig(caps_mb=ns.caps, rounds=ns.reps, steps=ns.steps, warmup=ns.warmup,
                       threads=ns.threads, network=network)


def _plot_path(path: str, model: str, several: bool) -> str:
    return path.replace(".png", f"_{model}.png") if several else path


def main(ns: argparse.Namespace) -> int:
    """`pycomm-bench ddp --sweep-bucket-cap`: sweep every model of --models."""
    cfg = config_from(ns)
    models = ns.models.split(",")
    backend = ns.backend or common.default_backend(ns.nproc)
    results = {}
    for name in models:
        title, result, steps = common.launch(_body, (cfg, name), ns.nproc, backend,
                                             timeout_s=3600.0, threads=cfg.threads)
        print(title)
        print(format_sweep(result))
        if ns.plot:
            print(draw(_plot_path(ns.plot, name, len(models) > 1), result, steps))
        sys.stdout.flush()
        results[name] = asdict(result)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"command": "pycomm-bench " + " ".join(sys.argv[1:]), "backend": backend,
                       "world": ns.nproc, "torch": torch.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "results": results}, f, indent=1)
    return 0
