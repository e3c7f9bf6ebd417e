"""Collective latency and bandwidth over a size sweep, in nccl-tests' columns and rigour.

Every argument is checked here, before any rank starts: a bad one is a one-line error
naming its flag and exit code 2, with nothing printed before it. Measuring lives in
collectives_run.py, the collectives in collective_ops.py, the output forms in report.py."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import shlex
import sys
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from . import common
from .collective_ops import COLLECTIVES, REDUCE_OPS
from .collectives_run import DTYPE_ALIASES, DTYPES, OPS, Config, run, skipped
from .report import write_csv, write_plot
from .sizes import format_size, parse_size, sweep

DEFAULT_MIN, DEFAULT_MAX = "8", "16M"   # the quick default job: a few seconds on Gloo
_MAX_SWEEP_POINTS = 10_000
# Peak bytes a rank holds for a size-S point (input, output, expected result, the pattern
# being generated), as a multiple of S.
_BUFFERS_PER_SIZE = 4


class UsageError(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("collective", nargs="*", default=["all_reduce"],
                   help=f"what to measure: {', '.join(COLLECTIVES)} or all "
                        f"(default all_reduce)")
    p.add_argument("-b", "--min-bytes", type=_size, default=parse_size(DEFAULT_MIN),
                   help=f"smallest size, K/M/G suffixes allowed (default {DEFAULT_MIN})")
    p.add_argument("-e", "--max-bytes", type=_size, default=parse_size(DEFAULT_MAX),
                   help=f"largest size (default {DEFAULT_MAX})")
    step = p.add_mutually_exclusive_group()
    step.add_argument("-f", "--step-factor", type=int, default=None,
                      help="multiply the size by this between points (default 2)")
    step.add_argument("-i", "--step-bytes", type=_size, default=None,
                      help="add this many bytes between points instead")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls (default 5)")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="calls in the back-to-back timed loop (default 20)")
    p.add_argument("--samples", type=int, default=None,
                   help="separately timed calls behind p50/p99/min/max (default: -n)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check every result on exact data first (default 1)")
    p.add_argument("-o", "--op", default="sum",
                   help=f"reduction(s), comma-separated: {', '.join(OPS)} or all (default sum)")
    p.add_argument("-d", "--dtype", default="float32",
                   help=f"type(s), comma-separated: {', '.join(DTYPES)} or all "
                        f"(default float32); also "
                        f"{', '.join(f'{a}={d}' for a, d in DTYPE_ALIASES.items())}")
    p.add_argument("-r", "--root", type=int, default=0,
                   help="root of broadcast and reduce (default 0)")
    p.add_argument("--ranks-avg", action="store_true",
                   help="average times across ranks (nccl-tests' default) instead of taking "
                        "the slowest rank")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to spawn (default 2; not under torchrun)")
    p.add_argument("--backend", default=None,
                   help="torch.distributed backend (default: nccl with a GPU per rank, "
                        "else gloo; required under torchrun)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more CPU ranks than cores (the figures then measure the "
                        "scheduler too; a warning says so in the output)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank; 0 keeps torch's default (default: 1 on "
                        "CPU backends)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--csv", metavar="PATH", help="also write the results as CSV")
    p.add_argument("--plot", metavar="PATH",
                   help="also draw busbw and latency against size as a PNG (matplotlib)")


def _names(text: str, known, aliases: dict, flag: str) -> tuple[str, ...]:
    names = [aliases.get(t.strip(), t.strip()) for t in text.split(",")]
    if names == ["all"]:
        return tuple(known)
    for name in names:
        if name not in known:
            raise UsageError(flag, f"unknown {name!r}; choose from {', '.join(known)} or all")
    return tuple(dict.fromkeys(names))


def _sizes(ns: argparse.Namespace) -> tuple[int, ...]:
    if ns.min_bytes < 1:
        raise UsageError("-b/--min-bytes", "must be at least 1 byte")
    if ns.max_bytes < ns.min_bytes:
        raise UsageError("-e/--max-bytes", f"{ns.max_bytes} is below -b ({ns.min_bytes})")
    if ns.step_factor is not None and ns.step_factor < 2:
        raise UsageError("-f/--step-factor", f"must be at least 2, got {ns.step_factor}")
    if ns.step_bytes is not None and ns.step_bytes < 1:
        raise UsageError("-i/--step-bytes", "must be at least 1 byte")
    factor = ns.step_factor or (0 if ns.step_bytes else 2)
    if not factor and (ns.max_bytes - ns.min_bytes) // ns.step_bytes >= _MAX_SWEEP_POINTS:
        raise UsageError("-i/--step-bytes", f"more than {_MAX_SWEEP_POINTS} sizes; "
                         f"use a larger step or -f")
    return tuple(sweep(ns.min_bytes, ns.max_bytes, factor, ns.step_bytes or 0))


def _world(ns: argparse.Namespace) -> tuple[int, Optional[str]]:
    """World size and backend, from torchrun's environment or the flags."""
    present = [k for k in common.TORCHRUN_ENV if k in os.environ]
    if present and len(present) < len(common.TORCHRUN_ENV):
        missing = sorted(set(common.TORCHRUN_ENV) - set(present))
        raise UsageError("torchrun", f"incomplete environment: {', '.join(present)} set but "
                         f"{', '.join(missing)} missing")
    if present:
        if ns.backend is None:
            raise UsageError("--backend", "required under torchrun (the ranks may sit on "
                             "different machines; name it, e.g. --backend nccl)")
        if ns.nproc is not None:
            raise UsageError("--nproc", "torchrun starts the ranks; drop --nproc")
        return int(os.environ["WORLD_SIZE"]), ns.backend
    nproc = 2 if ns.nproc is None else ns.nproc
    if nproc < 1:
        raise UsageError("--nproc", f"must be at least 1, got {nproc}")
    return nproc, ns.backend or common.default_backend(nproc)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _check_backend(backend: str, nproc: int, local: bool, oversubscribe: bool) -> None:
    available = getattr(dist, "is_backend_available", None)
    if not (available(backend) if available else backend in dist.Backend.backend_list):
        raise UsageError("--backend", f"{backend!r} is not available in this torch "
                         f"(known: {', '.join(dist.Backend.backend_list)})")
    if not local:
        return
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        raise UsageError("--nproc", f"{nproc} NCCL ranks need {nproc} GPUs; this machine "
                         f"has {torch.cuda.device_count()}")
    cores = _cores()
    if backend != "nccl" and nproc > cores and not oversubscribe:
        raise UsageError("--nproc", f"{nproc} CPU ranks on {cores} cores would measure the "
                         f"scheduler; use at most {cores} (or --oversubscribe)")


def _oversubscribed(backend: str, nproc: int, local: bool) -> str:
    if not local or backend == "nccl" or nproc <= _cores():
        return ""
    return (f"oversubscribed: {nproc} CPU ranks on {_cores()} cores (--oversubscribe); "
            f"these figures measure the scheduler as much as the backend")


def _check_memory(max_size: int, nproc: int) -> None:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    need = _BUFFERS_PER_SIZE * max_size * nproc
    if need > available:
        raise UsageError("-e/--max-bytes", f"{nproc} ranks at {max_size} B need about "
                         f"{need >> 20} MiB; {available >> 20} MiB are available")


def _check_outputs(ns: argparse.Namespace) -> None:
    for flag in ("json", "csv", "plot"):
        path = getattr(ns, flag)
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--{flag}", f"cannot write {path!r}: {folder} is not a "
                             f"writable folder")
    if ns.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot",
                         "needs matplotlib: pip install matplotlib (pycomm's `plot` extra)")


def _probe_reductions(backend: str, ops: tuple[str, ...], dtypes: tuple[str, ...]) -> None:
    """Ask the backend itself, on a one-rank group in this process, whether it reduces each
    requested (op, dtype): what a version supports (Gloo's avg, say) is then never guessed.
    Skipped for NCCL (no GPU is touched before the ranks start); inconclusive when even a
    float sum fails here, and then the ranks report."""
    if backend == "nccl" or dist.is_initialized():
        return
    try:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
    except Exception:
        return
    try:
        dist.all_reduce(torch.zeros(2))
    except Exception:
        dist.destroy_process_group()
        return
    try:
        for op in ops:
            for dtype in dtypes:
                if skipped(op, dtype):
                    continue
                try:
                    dist.all_reduce(torch.ones(2, dtype=DTYPES[dtype][0]), op=REDUCE_OPS[op])
                except Exception as e:
                    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    raise UsageError("-o/--op", f"{op} on {dtype} is not supported by "
                                     f"backend {backend} ({reason})") from None
    finally:
        dist.destroy_process_group()


def _command(ns: argparse.Namespace, cfg: Config, local: bool) -> str:
    step = ["-i", format_size(ns.step_bytes)] if ns.step_bytes else ["-f", str(ns.step_factor or 2)]
    args = ["pycomm-bench", "collectives", *cfg.collectives, "-b", format_size(ns.min_bytes),
            "-e", format_size(ns.max_bytes), *step, "-w", str(cfg.warmup), "-n", str(cfg.iters),
            "--samples", str(cfg.samples), "-c", str(int(cfg.check)), "-d", ",".join(cfg.dtypes),
            "-o", ",".join(cfg.ops), "-r", str(cfg.root), "--threads", str(cfg.threads or 0)]
    args += ["--ranks-avg"] if cfg.ranks_avg else []
    args += ["--nproc", str(ns.nproc or 2)] if local else []
    args += ["--oversubscribe"] if ns.oversubscribe else []
    return shlex.join(args + (["--backend", ns.backend] if ns.backend else []))


def configure(ns: argparse.Namespace) -> tuple[Config, int, str]:
    """Every check that can fail, in flag order: -> (config, nproc, backend)."""
    names = _names(",".join(ns.collective), COLLECTIVES, {}, "collective")
    sizes = _sizes(ns)
    for flag, value, low in (("-w/--warmup", ns.warmup, 0), ("-n/--iters", ns.iters, 1),
                             ("--samples", ns.samples, 1), ("--threads", ns.threads, 0)):
        if value is not None and value < low:
            raise UsageError(flag, f"must be at least {low}, got {value}")
    ops = _names(ns.op, OPS, {}, "-o/--op")
    dtypes = _names(ns.dtype, DTYPES, DTYPE_ALIASES, "-d/--dtype")
    reducing = any(COLLECTIVES[n].reduces for n in names)
    ints = [d for d in dtypes if not DTYPES[d][0].is_floating_point]
    if reducing and "avg" in ops and ints and "all" not in (ns.op, ns.dtype):
        # With `all` on either side the pair is skipped instead (see collectives_run).
        raise UsageError("-o/--op", f"avg needs a floating -d/--dtype (an {ints[0]} average "
                         "truncates, so its result is not exact)")
    world, backend = _world(ns)
    if not 0 <= ns.root < world:
        raise UsageError("-r/--root", f"{ns.root} is not a rank of a world of {world}")
    for name in names:
        if world < COLLECTIVES[name].min_world:
            raise UsageError("--nproc", f"{name} needs at least "
                             f"{COLLECTIVES[name].min_world} ranks, got {world}")
    local = not common.under_torchrun()
    _check_backend(backend, world, local, ns.oversubscribe)
    if local:
        _check_memory(sizes[-1], world)
    _check_outputs(ns)
    threads = ns.threads if ns.threads is not None else (None if backend == "nccl" else 1)
    cfg = Config(names, sizes, dtypes, ops if reducing else ("sum",), ns.root, ns.warmup,
                 ns.iters, ns.samples or ns.iters, bool(ns.check), ns.ranks_avg,
                 threads or None, ns.json, ns.csv, ns.plot, sys.stderr.isatty())
    if local and reducing:
        _probe_reductions(backend, cfg.ops, dtypes)
    return (replace(cfg, command=_command(ns, cfg, local),
                    warning=_oversubscribed(backend, world, local)), world, backend)


def _body(cfg: Config):
    lead = dist.get_rank() == 0
    report = run(cfg, emit=(lambda line: print(line, flush=True)) if lead else lambda _: None)
    if lead:
        if cfg.json:
            with open(cfg.json, "w") as f:
                f.write(report.to_json())
        if cfg.csv:
            write_csv(report, cfg.csv)
        if cfg.plot:
            write_plot(report, cfg.plot)
    return report


def main(ns: argparse.Namespace) -> int:
    """0: measured and every result correct; 1: some result wrong; 2: bad arguments."""
    try:
        cfg, nproc, backend = configure(ns)
    except UsageError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"pycomm-bench collectives: error: {e}", file=sys.stderr)
        return 2
    report = common.launch(_body, cfg, nproc, backend, threads=cfg.threads)
    return 1 if report.wrong else 0


__all__ = ["Config", "UsageError", "add_arguments", "configure", "main", "run"]
