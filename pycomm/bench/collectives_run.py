"""The measurement of `pycomm-bench collectives` on an initialized process group:
`run(config, emit) -> Report`. For every (collective, dtype, op, size, placement): an
untimed correctness pass on exact data, an untimed warm-up, the back-to-back timed loop,
the per-call sample loop, then one combination across ranks (max, or avg with
--ranks-avg). Arguments and their checking live in collectives.py."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .._version import __version__
from . import common, timing
from .collective_ops import COLLECTIVES, Case, Collective, Setting, count_wrong
from .report import Measure, Meta, Report, Row, footer, format_row, metadata_lines, section_header
from .sizes import format_size

# dtype name -> (torch dtype, nccl-tests' type name)
DTYPES = {"float32": (torch.float32, "float"), "float16": (torch.float16, "half"),
          "bfloat16": (torch.bfloat16, "bfloat16"), "float64": (torch.float64, "double"),
          "int32": (torch.int32, "int32"), "int64": (torch.int64, "int64")}
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                 "bf16": "bfloat16", "double": "float64", "fp64": "float64", "int": "int32",
                 "long": "int64"}
OPS = ("sum", "avg", "max", "min")

# Test-only: the rank named here adds 1 to one element of its result in the correctness
# pass, which must then be reported as #wrong > 0 and fail the command.
CORRUPT_ENV = "PYCOMM_BENCH_CORRUPT_RANK"


@dataclass(frozen=True)
class Config:
    collectives: tuple[str, ...] = ("all_reduce",)
    sizes: tuple[int, ...] = (8, 1 << 20)
    dtypes: tuple[str, ...] = ("float32",)
    ops: tuple[str, ...] = ("sum",)
    root: int = 0
    warmup: int = 5
    iters: int = 20
    samples: int = 20
    check: bool = True
    ranks_avg: bool = False
    threads: Optional[int] = 1
    json: Optional[str] = None
    csv: Optional[str] = None
    plot: Optional[str] = None
    progress: bool = False
    command: str = ""
    # Set when --oversubscribe let more CPU ranks run than there are cores: printed as a
    # warning under the header, since such figures measure the scheduler too.
    warning: str = ""


def skipped(op: str, dtype: str) -> bool:
    """Pairs a run leaves out: avg of integers truncates (its result is not exact)."""
    return op == "avg" and not DTYPES[dtype][0].is_floating_point


def _points(cfg: Config, world: int):
    """Every (collective, dtype, op, size, count) row of the run, in table order."""
    for name in cfg.collectives:
        coll = COLLECTIVES[name]
        if not coll.moves_data:
            yield coll, "float32", "none", 0, 0
            continue
        for dtype in cfg.dtypes:
            elt = DTYPES[dtype][0].itemsize
            for op in cfg.ops if coll.reduces else ("none",):
                if skipped(op, dtype):
                    continue
                for size in cfg.sizes:
                    count = coll.count(size, elt, world)
                    if count:
                        yield coll, dtype, op, coll.nbytes(count, elt, world), count


def _check(case: Case, s: Setting, device: torch.device) -> int:
    """Untimed: fill, one call, compare with the exact result (See Note [Exact data])."""
    case.fill()
    timing.synchronize(device)
    case.run()
    timing.synchronize(device)
    if case.result is not None and os.environ.get(CORRUPT_ENV) == str(s.rank):
        case.result.view(-1)[:1] += 1
    expected = case.expected()
    return 0 if expected is None else count_wrong(case.result, expected, s)


def _combine(mean: float, samples: list[float], wrong: Optional[int], cfg: Config,
             device: torch.device) -> tuple[float, torch.Tensor, Optional[int]]:
    """Across ranks: slowest rank (or the mean with --ranks-avg) per figure and per
    sample index; #wrong summed."""
    times = torch.tensor([mean, *samples], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.SUM if cfg.ranks_avg else dist.ReduceOp.MAX)
    if cfg.ranks_avg:
        times /= dist.get_world_size()
    if wrong is not None:
        w = torch.tensor([wrong], dtype=torch.int64, device=device)
        dist.all_reduce(w)
        wrong = int(w.item())
    times = times.cpu()
    return float(times[0]), times[1:], wrong


def _measure(coll: Collective, s: Setting, placement: str, size: int, cfg: Config) -> Measure:
    case = coll.case(s, placement)
    wrong = _check(case, s, s.device) if cfg.check else None
    case.fill()
    timing.warm_up(case.run, cfg.warmup, s.device)
    mean = timing.time_back_to_back(case.run, cfg.iters, s.device)
    samples = timing.time_each(case.run, cfg.samples, s.device)
    mean, per_call, wrong = _combine(mean, samples, wrong, cfg, s.device)
    q = torch.quantile(per_call, torch.tensor([0.5, 0.99], dtype=torch.float64))
    algbw, busbw = coll.bandwidths(size, mean, s.world)
    return Measure(placement, mean * 1e6, algbw, busbw, wrong,
                   float(q[0]) * 1e6, float(q[1]) * 1e6, float(per_call.min()) * 1e6,
                   float(per_call.max()) * 1e6)


def _progress(text: str) -> None:
    """One self-erasing status line on stderr (only used when stderr is a terminal)."""
    print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)


def _meta(cfg: Config, backend: str) -> Meta:
    return Meta(__version__, torch.__version__, backend, dist.get_world_size(),
                common.device_name(backend), platform.node(),
                datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                cfg.command, cfg.warmup, cfg.iters, cfg.samples, cfg.check,
                "avg" if cfg.ranks_avg else "max", cfg.threads)


def run(cfg: Config, emit: Callable[[str], None] = lambda line: None) -> Report:
    """Measure every point of `cfg` on the current group; `emit` gets the table's lines as
    they are ready (rank 0 passes print)."""
    backend, rank, world = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    device = common.device_of(backend)
    meta = _meta(cfg, backend)
    emit(metadata_lines(meta, ",".join(cfg.collectives)))
    if cfg.warning:
        emit(f"# WARNING: {cfg.warning}")
    points = list(_points(cfg, world))
    rows, section = [], None
    show = _progress if cfg.progress and rank == 0 else lambda _: None
    for i, (coll, dtype, op, size, count) in enumerate(points):
        if coll.name != section:
            section = coll.name
            emit(section_header(section, coll.placements))
        show(f"[{i + 1}/{len(points)}] {coll.name} {dtype} {op} {format_size(size)}B")
        s = Setting(rank, world, count, DTYPES[dtype][0], device, op if coll.reduces else "sum",
                    cfg.root)
        measures = tuple(_measure(coll, s, p, size, cfg) for p in coll.placements)
        type_name = "none" if not coll.moves_data else DTYPES[dtype][1]
        row = Row(coll.name, size, count, type_name, op,
                  cfg.root if coll.rooted else -1, measures)
        show("")
        emit(format_row(row))
        rows.append(row)
    report = Report(meta, tuple(rows))
    emit(footer(report))
    return report

