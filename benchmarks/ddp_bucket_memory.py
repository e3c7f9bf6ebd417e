"""What a DDP holds in memory for its gradient buckets, and when: torch's DDP with and
without `lazy_bucket_allocation` (torch 2.15, which allocates buckets during backward and
frees them after it) and with `gradient_as_bucket_view`, against pycomm's DDP at its
defaults (buckets reduced in place over its shared-memory group), through its bucket
buffers (`DDPConfig(in_place_reduction=False)`) and with `gradient_as_bucket_view`; the
module trained without any DDP ("plain") is the floor. 2 local Gloo ranks, 1 thread each,
CPU, a few SGD steps of a benchmark model (`pycomm.bench.models`), every implementation in
processes of its own so that each peak is its own, the implementations interleaved over
`--reps` repetitions (the order rotated each time); figures are medians over them of the
larger rank's value.

Measured from /proc, in MB, each against `base`, the resident memory once the model, its
input and its SGD optimizer were built (glibc told to return freed blocks, as
benchmarks/zero_memory.py does, so that resident memory follows what is live). What a
process loads once is taken before `base`: a first SGD step of the bare module (its
kernels and torch's optimizer, which imports torch._dynamo: some 90 MB on torch 2.13),
then a 4 x 4 Linear wrapped by the same implementation and dropped (a first torch DDP
imports several hundred modules unless the optimizer did; pycomm's makes its
shared-memory group). What follows is what the DDP holds for this model.
  first_wrap   resident left by that first, tiny wrap (the one-off cost; not in base)
  built        resident after construction: what the DDP holds before any step
  build_peak   the high-water mark during construction (the initial broadcast included)
  bwd1_peak    the high-water mark during the first backward (reset just before it)
  after_bwd1   resident once the first backward returned (the gradients included)
  step2_peak   the high-water mark over the second step (both DDPs re-cut their buckets)
  steady_peak  the high-water mark over the later steps (forward, backward, SGD step)
  between      resident after the last zero_grad(set_to_none=True): held between steps
For pycomm also the bytes of its bucket buffers (`reducer.grad_view`'s storages) and how
many of them are resident (mincore); torch's reducer does not expose its buckets. Resident
memory counts the pages of pycomm's shared-memory segment a rank has touched in each rank
(`shm`: RssShmem at the end). "plain" is the floor: gradients, activations, SGD.
"pycomm_dropped" is a what-if, not a configuration: pycomm's defaults with the pages of its
bucket buffers that hold only zeros handed back to the kernel after construction and after
the re-cut, which shows whether the in-place path ever writes them (`resident` stays 0)
and what pycomm would hold if it allocated them without writing them.

    python benchmarks/ddp_bucket_memory.py [--models mlp,transformer_b1] [--reps 3]
        [--steps 5] [--impls ...] [--json PATH]

Recorded (torch 2.15, see benchmarks/results/ddp_bucket_memory_cpu.md):
    /work/venv215/bin/python /work/main/benchmarks/ddp_bucket_memory.py --json
        /work/main/benchmarks/results/ddp_bucket_memory_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import inspect
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from zero_memory import _peak_mb, _reset_peak, _resident_mb, _return_freed_memory

import pycomm
from pycomm.bench import common
from pycomm.bench.models import build_model


def _shmem_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024 / 1e6  # in KiB
    return float("nan")


def _bucket_storages(ddp: nn.Module) -> list:
    """pycomm's bucket buffers, one storage each (`grad_view` is a view of its bucket's)."""
    storages = {}
    for i in range(len(ddp._named_params)):
        s = ddp.reducer.grad_view(i).untyped_storage()
        storages[s.data_ptr()] = s
    return list(storages.values())


def _pages(storage) -> tuple[int, int, int]:
    """(first page address, length in bytes, page size) of the pages `storage` touches."""
    page = resource.getpagesize()
    start = storage.data_ptr() & ~(page - 1)
    return start, storage.data_ptr() + storage.nbytes() - start, page


def _resident_bytes(storage) -> int:
    """Bytes of `storage`'s pages that are in memory (mincore: pages never written are not)."""
    start, length, page = _pages(storage)
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages):
        return -1
    return sum(p & 1 for p in pages) * page


def _pycomm_buckets(model: nn.Module) -> tuple[float, float]:
    """pycomm's bucket buffers: (MB allocated, MB resident); nan for anything else."""
    if not isinstance(model, pycomm.DistributedDataParallel):
        return float("nan"), float("nan")
    storages = _bucket_storages(model)
    return (sum(s.nbytes() for s in storages) / 1e6,
            sum(_resident_bytes(s) for s in storages) / 1e6)


def _drop_zero_buckets(ddp: nn.Module) -> nn.Module:
    """Hand the pages of pycomm's bucket buffers that hold only zeros back to the kernel:
    a private anonymous page dropped (MADV_DONTNEED) reads as zeros again, so the buffers'
    values are unchanged, and a page becomes resident again only when something writes it.
    What pycomm would hold had it allocated its buffers without writing them."""
    madv_dontneed = 4
    for s in _bucket_storages(ddp):
        if torch.empty(0, dtype=torch.uint8).set_(s).any():
            continue  # a bucket that holds gradients
        page = resource.getpagesize()
        first = (s.data_ptr() + page - 1) & ~(page - 1)  # whole pages of this buffer only
        end = (s.data_ptr() + s.nbytes()) & ~(page - 1)
        if end > first:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first),
                                      madv_dontneed)
    return ddp


TORCH_HAS_LAZY = "lazy_bucket_allocation" in inspect.signature(TorchDDP.__init__).parameters


def _pycomm(**kw) -> Callable[[nn.Module], nn.Module]:  # both at their default bucket caps
    return lambda m: pycomm.DistributedDataParallel(m, **kw)


def _torch(**kw) -> Callable[[nn.Module], nn.Module]:
    return lambda m: TorchDDP(m, **kw)


IMPLS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,  # no DDP, no communication: gradients and activations alone
    "torch": _torch(),
    "torch_view": _torch(gradient_as_bucket_view=True),
    "torch_lazy": _torch(lazy_bucket_allocation=True),
    "torch_lazy_view": _torch(lazy_bucket_allocation=True, gradient_as_bucket_view=True),
    "pycomm": _pycomm(),
    "pycomm_bucketed": _pycomm(config=pycomm.DDPConfig(in_place_reduction=False)),
    "pycomm_view": _pycomm(gradient_as_bucket_view=True),
    # DDPConfig's field, on any torch (the keyword argument needs torch >= 2.15)
    "pycomm_lazy": _pycomm(config=pycomm.DDPConfig(lazy_bucket_allocation=True)),
    "pycomm_bucketed_lazy": _pycomm(config=pycomm.DDPConfig(in_place_reduction=False,
                                                            lazy_bucket_allocation=True)),
    # A what-if, not a configuration: pycomm's defaults with the zeros of its bucket buffers
    # dropped after construction and again after the re-cut (_drop_zero_buckets).
    "pycomm_dropped": lambda m: _drop_zero_buckets(pycomm.DistributedDataParallel(m)),
}
AFTER_RECUT = {"pycomm_dropped": _drop_zero_buckets}  # called after the second step
NEEDS_LAZY = ("torch_lazy", "torch_lazy_view")
FIELDS = ("first_wrap", "built", "build_peak", "bwd1_peak", "after_bwd1", "step2_peak",
          "steady_peak", "between", "buckets", "buckets_resident", "shm")


@dataclasses.dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = ("mlp", "transformer_b1")
    impls: tuple[str, ...] = tuple(IMPLS)
    reps: int = 3
    steps: int = 5  # step 0 is the first, step 1 re-cuts the buckets, the rest are steady
    samples: int = 32  # the MLP's batch per rank


@dataclasses.dataclass(frozen=True)
class Run:
    """One implementation in one pair of processes: MB, the larger rank's."""
    model: str
    impl: str
    rep: int
    first_wrap: float  # resident left by wrapping a 4 x 4 Linear first (libraries, groups)
    built: float
    build_peak: float
    bwd1_peak: float
    after_bwd1: float
    step2_peak: float
    steady_peak: float
    between: float
    buckets: float  # pycomm's bucket buffers (nan for torch and plain)
    buckets_resident: float  # of which resident
    shm: float  # RssShmem at the end


@dataclasses.dataclass(frozen=True)
class Row:
    """Medians over repetitions of one implementation on one model."""
    model: str
    impl: str
    reps: int
    medians: dict[str, float]
    ranges: dict[str, tuple[float, float]]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _rank(args: tuple[str, str, int, int]) -> dict:
    model_name, impl, steps, samples = args
    _return_freed_memory()
    module, x = build_model(model_name, samples)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)  # the DDP's parameters too
    _step(module, opt, x)  # See the module's docstring: what a first step and DDP load
    opt.zero_grad()
    start = _resident_mb()
    IMPLS[impl](nn.Linear(4, 4))
    gc.collect()
    base = _resident_mb()
    _reset_peak()
    model = IMPLS[impl](module)
    m = {"first_wrap": base - start, "build_peak": _peak_mb() - base,
         "built": _resident_mb() - base}
    for step in range(steps):
        if step == 0:
            opt.zero_grad()
            loss = model(x).square().mean()
            _reset_peak()
            loss.backward()
            m["bwd1_peak"], m["after_bwd1"] = _peak_mb() - base, _resident_mb() - base
            opt.step()
            del loss
            continue
        if step in (1, 2):
            _reset_peak()
        _step(model, opt, x)
        if step == 1:
            m["step2_peak"] = _peak_mb() - base
            AFTER_RECUT.get(impl, lambda ddp: ddp)(model)
    m["steady_peak"] = _peak_mb() - base
    m["buckets"], m["buckets_resident"] = _pycomm_buckets(model)
    opt.zero_grad()
    m["between"], m["shm"] = _resident_mb() - base, _shmem_mb()
    t = torch.tensor([m[f] for f in FIELDS], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(FIELDS, t.tolist()))


def run(cfg: Config) -> list[Run]:
    impls = [i for i in cfg.impls if TORCH_HAS_LAZY or i not in NEEDS_LAZY]
    runs = []
    for rep in range(cfg.reps):
        order = impls[rep % len(impls):] + impls[:rep % len(impls)]
        for model in cfg.models:
            for impl in order:
                got = common.launch(_rank, (model, impl, cfg.steps, cfg.samples), 2, "gloo",
                                    timeout_s=600.0, threads=1)
                runs.append(Run(model=model, impl=impl, rep=rep, **got))
                print(f"# rep {rep} {model} {impl}: " + " ".join(
                    f"{f} {got[f]:.1f}" for f in FIELDS), flush=True)
    return runs


def summarize(cfg: Config, runs: list[Run]) -> list[Row]:
    rows = []
    for model in cfg.models:
        for impl in cfg.impls:
            mine = [r for r in runs if r.model == model and r.impl == impl]
            if not mine:
                continue
            values = {f: [getattr(r, f) for r in mine] for f in FIELDS}
            rows.append(Row(model=model, impl=impl, reps=len(mine),
                            medians={f: statistics.median(v) for f, v in values.items()},
                            ranges={f: (min(v), max(v)) for f, v in values.items()}))
    return rows


def _git_commit(path: str) -> str:
    """The commit of the pycomm that ran, with '+dirty' for uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", "-C", path, *a], capture_output=True, text=True,
                              check=False).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def metadata(cfg: Config) -> dict:
    where = os.path.dirname(os.path.dirname(os.path.abspath(pycomm.__file__)))
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"pycomm": pycomm.__version__, "pycomm_path": where, "commit": _git_commit(where),
            "torch": torch.__version__, "torch_has_lazy_bucket_allocation": TORCH_HAS_LAZY,
            "backend": "gloo", "world": 2, "threads": 1, "host": platform.node(),
            "cpu": f"{_cpu_model()}, {os.cpu_count()} cores, {mem_gb:.1f} GiB",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([sys.executable, *sys.argv]),
            "config": dataclasses.asdict(cfg)}


_HEADS = (("first", "wrap"), ("built", ""), ("build", "peak"), ("bwd1", "peak"),
          ("after", "bwd1"), ("step2", "peak"), ("steady", "peak"), ("between", "steps"),
          ("buckets", "pycomm"), ("resident", "buckets"), ("shm", "RSS"))


def format_rows(meta: dict, rows: list[Row]) -> str:
    cfg = meta["config"]
    out = [f"# pycomm {meta['pycomm']} ({meta['commit']}) | torch {meta['torch']} | backend "
           f"gloo | world 2 | {meta['cpu']} | host {meta['host']} | {meta['date']}",
           f"# steps {cfg['steps']} | reps {cfg['reps']} | ranks: max | threads 1 | bucket caps "
           f"torch's defaults | load {meta['load_before']} -> {meta['load_after']}",
           f"# command: {meta['command']}",
           "# medians, MB over the resident memory of the built model (See the docstring)",
           "#" + f"{'model':>14}{'impl':>22}" + "".join(f"{h:>9}" for h, _ in _HEADS),
           "#" + " " * 36 + "".join(f"{u:>9}" for _, u in _HEADS)]
    for r in rows:
        out.append(f"{r.model:>15}{r.impl:>22}"
                   + "".join(f"{r.medians[f]:9.1f}" for f in FIELDS))
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(Config.models))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    unknown = set(ns.impls.split(",")) - set(IMPLS)
    if unknown or ns.steps < 3:
        p.error(f"unknown --impls {sorted(unknown)} (known: {','.join(IMPLS)})" if unknown
                else "--steps must be at least 3 (first, re-cut, steady)")
    cfg = Config(models=tuple(ns.models.split(",")), impls=tuple(ns.impls.split(",")),
                 reps=ns.reps, steps=ns.steps)
    if not TORCH_HAS_LAZY:
        print(f"# torch {torch.__version__} has no lazy_bucket_allocation: "
              f"{','.join(NEEDS_LAZY)} skipped", flush=True)
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    runs = run(cfg)
    meta = {**metadata(cfg), "load_before": load_before,
            "load_after": " ".join(f"{v:.2f}" for v in os.getloadavg())}
    rows = summarize(cfg, runs)
    print(format_rows(meta, rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({**meta, "rows": [dataclasses.asdict(r) for r in rows],
                       "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
