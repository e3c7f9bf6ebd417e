"""DDP step time, pycomm vs torch, side by side on the same model and data.

Both train in one run, interleaved, medians; exposed communication = step time - the same
step in no_sync.

Models (each ~25M parameters; the work per rank per step is printed with the figures):
  mlp             6 x Linear(2048, 2048), 32 samples per rank per step
  transformer     8 encoder layers (d_model 512, ff 2048), 4 x 64 = 256 tokens per rank:
                  compute-heavy, ~1 s steps where communication is a few % of the step
  transformer_b1  the same model with 1 x 64 = 64 tokens per rank, the small per-rank batch
                  of data-parallel training where gradient communication matters
Process CPU time per step (all threads, slowest rank) is reported beside wall time: on a
machine whose cores all compute, CPU spent moving bytes lengthens the step one for one.

--compile times each implementation under torch.compile(ddp) ("torch+compile",
"pycomm+compile"), and pycomm in eager mode beside them: the overlap column (pycomm's
step reports, the least overlapped rank) then shows what compilation keeps of eager
overlap. Compilation and the first steps' recompilations happen in the untimed warm-up."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..clip import clip_grad_norm_ as pycomm_clip_grad_norm_
from ..config import DDPConfig
from ..ddp import DistributedDataParallel as PycommDDP
from ..overlap import write_chrome_trace
from . import bucket_sweep, common, sharded
from .collectives import UsageError
from .collectives_run import _progress as _status_line
from .models import MODELS, build_model, per_rank


def _bf16_compress(group, bucket):  # no annotations: torch checks them by identity
    """torch's bf16_compress_hook step for step (cast to bf16, divide by the world, sum
    all-reduce in bf16 over the group, copy back), which torch's DDP refuses to register
    unless NCCL runs it (its check goes by the hook's name): the anchor on Gloo."""
    buffer = bucket.buffer()
    world = dist.get_world_size(group)
    compressed = buffer.to(torch.bfloat16).div_(world)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def _bf16_hooked(module, **kw):
    ddp = TorchDDP(module, **kw)
    ddp.register_comm_hook(None, _bf16_compress)
    return ddp


IMPLS = {
    "torch": TorchDDP,
    "pycomm": PycommDDP,
    # pycomm with every bucket's all-reduce on the backward thread (see Note [Inline
    # collectives] in csrc/reducer/launch.cpp): only with --impls, for comparison.
    "pycomm_inline": lambda m, **kw: PycommDDP(m, config=DDPConfig(inline_collectives=True,
                                                                   **kw)),
    # pycomm copying gradients with ATen instead of streaming stores (Note [Streaming
    # copies] in csrc/reducer/stream_copy.cpp): only with --impls, for comparison.
    "pycomm_nostream": lambda m, **kw: PycommDDP(m, config=DDPConfig(streaming_copies=False,
                                                                     **kw)),
    # pycomm with every bucket reduced through its buffer (Note [Gradients reduced in
    # place] in csrc/reducer/in_place.cpp): only with --impls, for comparison.
    "pycomm_bucketed": lambda m, **kw: PycommDDP(m, config=DDPConfig(in_place_reduction=False,
                                                                     **kw)),
    # pycomm on the group's own Gloo backend, as with one rank per host: no shared memory,
    # a step label exchange per step (Note [Step labels over the group] in
    # csrc/comm/step_label.cpp): only with --impls, for comparison.
    "pycomm_gloo": lambda m, **kw: PycommDDP(m, config=DDPConfig(shared_memory_gradients=False,
                                                                 **kw)),
    # pycomm without the hierarchical all-reduce across hosts (flat Gloo, as torch's).
    "pycomm_flat": lambda m, **kw: PycommDDP(m, config=DDPConfig(hierarchical_allreduce=False,
                                                                 **kw)),
    # What crosses hosts (DDPConfig.wire, Note [Low-precision wire] in
    # csrc/shm/wire_codec.h): bf16, int8 and int8 with error feedback, summed in float32;
    # torch's anchor casts to bf16 and all-reduces in it (its bf16_compress_hook).
    "pycomm_wire_bf16": lambda m, **kw: PycommDDP(m, config=DDPConfig(wire="bf16", **kw)),
    "pycomm_wire_int8": lambda m, **kw: PycommDDP(m, config=DDPConfig(wire="int8", **kw)),
    "pycomm_wire_int8_ef": lambda m, **kw: PycommDDP(
        m, config=DDPConfig(wire="int8", wire_error_feedback=True, **kw)),
    # The wires through the bucket's buffer (as before the hierarchy reduced in place):
    # only with --impls, for comparison.
    "pycomm_wire_bf16_bucketed": lambda m, **kw: PycommDDP(
        m, config=DDPConfig(wire="bf16", in_place_reduction=False, **kw)),
    "pycomm_wire_int8_bucketed": lambda m, **kw: PycommDDP(
        m, config=DDPConfig(wire="int8", in_place_reduction=False, **kw)),
    "torch_bf16_hook": _bf16_hooked,
    # Sharded data parallelism (sharded.py): pycomm's ZeroRedundancyOptimizer on its DDP
    # (gradients kept, or released), torch's on torch's DDP, FSDP2. The default set with
    # --optimizer adamw.
    "pycomm_zero": sharded.pycomm_zero,
    "pycomm_zero_released": sharded.pycomm_zero,
    **{impl: sharded.pycomm_zero_wire(wire) for impl, wire in sharded.ZERO_WIRES.items()},
    "torch_zero": sharded.torch_zero,
    "fsdp2": sharded.fsdp2,
    # FSDP2 on a group of the same ranks over pycomm's shared-memory backend: only with
    # --impls, for comparison with "fsdp2" (Gloo).
    "fsdp2_pycomm": sharded.fsdp2_pycomm,
    **{impl: sharded.fsdp2_pycomm_wire(wire) for impl, wire in sharded.FSDP2_WIRES.items()},
}
IMPLS.update({anchor: IMPLS[of] for anchor, of in sharded.ANCHORS.items()})
DEFAULT_IMPLS = ("torch", "pycomm")
COMPILED = "+compile"  # suffix of an implementation run under torch.compile(ddp)


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = MODELS
    impls: tuple[str, ...] = DEFAULT_IMPLS
    bucket_cap_mb: float = 25.0
    warmup: int = 3
    reps: int = 5
    steps: int = 4
    threads: int = 1
    compile: bool = False
    compile_backend: str = "inductor"
    hosts: str = ""  # "2 hosts x 2 ranks, link 1 Gbit/s (tbf)" for a --hosts run
    samples: int = 32  # the MLP's batch per rank
    clip: float = 0.0  # max_norm of each implementation's gradient clipping; 0: none
    trace: str = ""  # folder for each pycomm variant's Chrome trace of its last timed steps
    progress: bool = False  # rank 0 says on stderr which model, variant and rep runs
    optimizer: str = "sgd"  # sharded.OPTIMIZERS: every implementation steps this one
    # where the model lives: "" for the backend's device (a GPU under NCCL, else the CPU);
    # "cuda" puts Gloo ranks on the GPU (several ranks sharing one device)
    device: str = ""

    def variants(self) -> tuple[str, ...]:
        """The implementations timed: each of `impls`, or with `compile` each compiled and
        pycomm in eager mode too (the reference of its overlap)."""
        if not self.compile:
            return self.impls
        eager = ("pycomm",) if "pycomm" in self.impls else ()
        return tuple(i + COMPILED for i in self.impls) + eager


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
    overlap: float          # pycomm: median of the least overlapped rank's step; torch: nan
    wire_mb: float = float("nan")  # per synchronized step, MB host 0 sent on its link (--hosts)
    state_mb: float = float("nan")  # optimizer state held by a rank (the largest)
    mem_mb: float = float("nan")  # resident memory the implementation added (build + warm-up)
    gather_hidden: float = float("nan")  # pycomm_zero: share of its all-gathers not waited for
    forward_ms: float = float("nan")  # median: zero_grad + forward (all-gather waits included)
    opt_ms: float = float("nan")      # median: the optimizer's step() call
    no_sync_fb_ms: float = float("nan")  # median no_sync step less its optimizer step
    copy_gb_s: float = float("nan")   # a rank's copy bandwidth, all ranks copying at once


def _build(variant: str, module: nn.Module, cfg: Config) -> tuple[nn.Module, nn.Module]:
    """(what a step calls, the DDP module) of one implementation."""
    impl = variant.removesuffix(COMPILED)
    ddp = IMPLS[impl](copy.deepcopy(module), bucket_cap_mb=cfg.bucket_cap_mb)
    if variant.endswith(COMPILED):
        return torch.compile(ddp, backend=cfg.compile_backend), ddp
    return ddp, ddp


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          clip: Optional[Callable[[], object]] = None) -> tuple[float, ...]:
    """(wall, backward, process CPU, forward, optimizer step) seconds of one training step;
    `clip` runs between backward and the optimizer. On CUDA the step starts and ends with
    the device idle (synchronized), and backward is the device's time between events
    around the call (forward and the optimizer step are host times there)."""
    on_gpu = x.is_cuda
    if on_gpu:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    cpu = time.process_time()
    start = time.perf_counter()
    opt.zero_grad()
    loss = model(x).float().square().mean()
    bwd = time.perf_counter()
    if on_gpu:
        events[0].record()
    loss.backward()
    bwd_end = time.perf_counter()
    if on_gpu:
        events[1].record()
    if clip is not None:
        clip()
    opt_start = time.perf_counter()
    opt.step()
    opt_end = time.perf_counter()
    if on_gpu:
        torch.cuda.synchronize()
    backward = events[0].elapsed_time(events[1]) / 1e3 if on_gpu else bwd_end - bwd
    return (time.perf_counter() - start, backward, time.process_time() - cpu, bwd - start,
            opt_end - opt_start)


def _clipper(ddp: nn.Module, max_norm: float, no_sync: bool) -> Optional[Callable[[], object]]:
    """Each implementation's own gradient clipping (None when max_norm is 0): pycomm's
    DDP.clip_grad_norm_ on synchronized steps and its fused pycomm.clip_grad_norm_ under
    no_sync (local gradients); torch's clip_grad_norm_ (foreach) in both."""
    if not max_norm:
        return None
    if isinstance(ddp, PycommDDP):
        if no_sync:
            return lambda: pycomm_clip_grad_norm_(ddp.parameters(), max_norm)
        return lambda: ddp.clip_grad_norm_(max_norm)
    return lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)


def _timed(model, ddp, opt, x, steps: int, no_sync: bool,
           clip_norm: float = 0.0) -> list[tuple[float, ...]]:
    out = []
    clip = _clipper(ddp, clip_norm, no_sync)
    for _ in range(steps):
        dist.barrier()
        if no_sync:
            with sharded.no_sync(ddp):
                out.append(_step(model, opt, x, clip))
        else:
            out.append(_step(model, opt, x, clip))
    return out


def _settle(opt: torch.optim.Optimizer) -> None:
    """Wait for what a sharded optimizer's last step left running (overlap_with_ddp runs the
    parameter all-gathers behind the next forward): those bytes belong to the steps that
    issued them, and must not cross the link while the next block is timed."""
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()


def _wire_bytes() -> float:
    """Bytes this host sent so far on the interface Gloo uses across hosts
    (GLOO_SOCKET_IFNAME, set by --hosts runs), or nan elsewhere."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return float("nan")
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return float(f.read())
    except OSError:
        return float("nan")


def _overlaps(ddp: nn.Module, steps: int) -> list[float]:
    """pycomm's overlap of the last `steps` synchronized steps, the least of the ranks'."""
    if not isinstance(ddp, PycommDDP):
        return [float("nan")] * steps
    t = torch.tensor([r.overlap for r in ddp.step_reports(steps)], dtype=torch.float64,
                     device=common.device_of(dist.get_backend()))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def _memory_bytes(device: torch.device) -> float:
    """What the mem_MB column counts: on a GPU the device memory torch's allocator holds
    for tensors (host memory says nothing of it), else this process's resident memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return float(torch.cuda.memory_allocated(device))
    return _resident_bytes()


def _resident_bytes() -> float:
    """This process's resident memory now (Linux /proc; nan elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return float("nan")


def _rank_min(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=common.device_of(dist.get_backend()))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def _rank_max(samples: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    t = torch.tensor(samples, dtype=torch.float64, device=common.device_of(dist.get_backend()))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [tuple(r) for r in t.tolist()]


def _say(cfg: Config, text: str) -> None:
    """Progress on rank 0's stderr: one self-erasing line on a terminal, else a line each."""
    if not cfg.progress or dist.get_rank() != 0:
        return
    if sys.stderr.isatty():
        _status_line(f"pycomm-bench ddp: {text}")
    else:
        print(f"# progress: {text}", file=sys.stderr, flush=True)


def run_model(cfg: Config, name: str) -> list[Result]:
    module, x = build_model(name, cfg.samples)
    device = (torch.device(cfg.device) if cfg.device  # the rank's GPU under NCCL
              else common.device_of(dist.get_backend()))
    module, x = module.to(device), x.to(device)
    variants = cfg.variants()
    runs = {}
    for variant in variants:
        _say(cfg, f"{name}: building and warming up {variant}")
        before = _memory_bytes(device)
        model, ddp = _build(variant, module, cfg)
        opt = sharded.optimizer(variant.removesuffix(COMPILED), ddp, cfg.optimizer)
        for _ in range(cfg.warmup):
            _step(model, opt, x)
        _timed(model, ddp, opt, x, 1, no_sync=True)  # a compiled no_sync step may recompile
        _settle(opt)
        added = [_memory_bytes(device) - before, sharded.state_bytes(opt)]
        runs[variant] = (model, ddp, opt, {False: [], True: [], "overlap": [], "wire": [],
                                           "hidden": [], "memory": _rank_max([added])[0]})
    for rep in range(cfg.reps):  # interleaved, alternating who goes first
        _say(cfg, f"{name}: rep {rep + 1} of {cfg.reps} ({', '.join(variants)})")
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for variant in order:
            model, ddp, opt, samples = runs[variant]
            for no_sync in (False, True):
                sent = _wire_bytes()
                samples[no_sync] += _rank_max(_timed(model, ddp, opt, x, cfg.steps, no_sync,
                                                     cfg.clip))
                if not no_sync:  # before _settle, whose wait is the bench's, not the forward's
                    samples["overlap"] += _overlaps(ddp, cfg.steps)
                    samples["hidden"].append(_rank_min(sharded.gather_hidden(opt, cfg.steps)))
                _settle(opt)  # these steps' last all-gathers are theirs
                if not no_sync:
                    samples["wire"].append((_wire_bytes() - sent) / cfg.steps)
    if cfg.trace:
        _write_traces(cfg, name, runs)
    params = sum(p.numel() for p in module.parameters())
    results = []
    copy = _copy_gb_s(device)
    for variant, (_, _, _, samples) in runs.items():
        step, bwd, cpu, fwd, opt_step = (statistics.median(s[i] for s in samples[False]) * 1e3
                                         for i in range(5))
        quiet, _, quiet_cpu = (statistics.median(s[i] for s in samples[True]) * 1e3
                               for i in range(3))
        quiet_fb = statistics.median(s[0] - s[4] for s in samples[True]) * 1e3
        added, state = samples["memory"]
        results.append(Result(name, params, per_rank(name, x), variant, step, bwd, quiet,
                              step - quiet, cpu, quiet_cpu, _median(samples["overlap"]),
                              _median(samples["wire"]) / 1e6, state / 1e6, added / 1e6,
                              _median(samples["hidden"]), fwd, opt_step, quiet_fb, copy))
    return results


def _copy_gb_s(device: torch.device) -> float:
    """GB/s (read + written) of one rank copying 64 MiB of float32 while every rank copies
    at once: what the optimizer bound divides by. The least of the ranks; median of 5."""
    src = torch.randn(16 << 20, device=device)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(6):
        dist.barrier()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return _rank_min(2 * src.numel() * 4 / statistics.median(seconds[1:]) / 1e9)


def _write_traces(cfg: Config, name: str, runs: dict) -> None:
    """Each pycomm variant's last timed synchronized steps, every rank's, as one Chrome trace
    (rank 0 writes cfg.trace/ddp_<model>_<variant>.json)."""
    for variant, (_, ddp, opt, _) in runs.items():
        if isinstance(ddp, PycommDDP):
            path = os.path.join(cfg.trace, f"ddp_{name}_{variant.replace('+', '_')}.json")
            write_chrome_trace(path, sharded.with_gathers(ddp.step_reports(cfg.steps), opt),
                               all_ranks=True, group=ddp.process_group)


def _median(values: list[float]) -> float:
    known = [v for v in values if v == v]
    return statistics.median(known) if known else float("nan")


def run(cfg: Config) -> list[Result]:
    return [r for name in cfg.models for r in run_model(cfg, name)]


def format_results(cfg: Config, results: list[Result], allocator: str = "") -> str:
    extra = {"compile": cfg.compile_backend} if cfg.compile else {}
    if cfg.clip:
        extra["clip"] = f"max_norm {cfg.clip:g} (each its own clip_grad_norm_)"
    wire = any(r.wire_mb == r.wire_mb for r in results)
    memory = cfg.optimizer != "sgd" or any(r.impl in sharded.SHARDED for r in results)
    if cfg.optimizer != "sgd":
        extra["optimizer"] = cfg.optimizer
    where = {"hosts": cfg.hosts} if cfg.hosts else {}
    lines = [common.header("ddp step time (ms), medians of per-step max over ranks",
                           bucket_cap_mb=cfg.bucket_cap_mb, threads=cfg.threads,
                           warmup=cfg.warmup, reps=cfg.reps, steps=cfg.steps, **extra,
                           **where, **({"allocator": allocator} if allocator else {})),
             f"#{'model':>15} {'params':>9} {'per rank/step':>19} {'impl':>16} {'step':>7} "
             f"{'forward':>7} {'backward':>8} {'opt':>6} {'no_sync':>7} {'exposed':>7} "
             f"{'cpu':>7} {'cpu_ns':>7} "
             f"{'overlap':>7}" + (f" {'wire_MB':>7}" if wire else "") +
             (f" {'state_MB':>8} {'mem_MB':>7} {'ag_hid':>6}" if memory else "")]
    for r in results:
        lines.append(f"{r.model:>16} {r.params:>9} {r.per_rank:>19} {r.impl:>16} "
                     f"{r.step_ms:>7.1f} {r.forward_ms:>7.1f} {r.backward_ms:>8.1f} "
                     f"{r.opt_ms:>6.1f} {r.no_sync_step_ms:>7.1f} "
                     f"{r.exposed_ms:>7.1f} {r.cpu_ms:>7.1f} {r.no_sync_cpu_ms:>7.1f} "
                     f"{r.overlap:>7.2f}" + (f" {r.wire_mb:>7.1f}" if wire else "") +
                     (f" {r.state_mb:>8.1f} {r.mem_mb:>7.1f} {r.gather_hidden:>6.2f}"
                      if memory else ""))
    lines.append("# forward: zero_grad + forward (waits for all-gathers included); opt: the "
                 "optimizer's step() call; cpu: process CPU ms per step (all threads); "
                 "cpu_ns: the same in no_sync; "
                 "overlap: pycomm's, median step of the least overlapped rank" +
                 ("; wire_MB: what host 0 sent on its link per synchronized step" if wire
                  else "") +
                 ("; state_MB: optimizer state per rank (the largest); mem_MB: memory the "
                  "implementation added while built and warmed up, resident on CPU, "
                  "allocated on the GPU (the largest rank); ag_hid: share of pycomm_zero's "
                  "parameter all-gather time the forward did not wait for (least of the "
                  "ranks)" if memory else ""))
    for name in dict.fromkeys(r.model for r in results):
        rows = {r.impl: r for r in results if r.model == name}
        lines += _comparisons(name, rows)
    return "\n".join(lines)


def _comparisons(name: str, rows: dict[str, Result]) -> list[str]:
    """Each row against torch's of the same mode; compiled pycomm's overlap against eager."""
    lines = []
    floor = min(r.no_sync_step_ms for r in rows.values())
    lines.append(f"# {name}: floor (the fastest no_sync step, no communication) {floor:.1f} ms: " +
                 ", ".join(f"{impl}/floor {r.step_ms / floor:.3f}" for impl, r in rows.items()))
    for impl, p in rows.items():
        t = rows.get("torch" + COMPILED if impl.endswith(COMPILED) else "torch")
        if t is None or p is t:
            continue
        exposed = p.exposed_ms / t.exposed_ms if t.exposed_ms > 0 else float("nan")
        lines.append(f"# {name}: {impl}/{t.impl} step {p.step_ms / t.step_ms:.3f}, backward "
                     f"{p.backward_ms / t.backward_ms:.3f}, exposed {exposed:.3f}, "
                     f"communication CPU {p.cpu_ms - p.no_sync_cpu_ms:.1f} ms vs "
                     f"{t.cpu_ms - t.no_sync_cpu_ms:.1f} ms")
    for zero_impl in sharded.PYCOMM_ZERO:
        zero = rows.get(zero_impl)
        if zero is None:
            continue
        others = [r for impl, r in rows.items() if impl not in sharded.PYCOMM_ZERO]
        torch_rows = [r for r in others if r.impl.startswith(("torch", "fsdp2"))
                      and not r.impl.startswith("fsdp2_pycomm")]
        best = min(torch_rows, key=lambda r: r.step_ms) if torch_rows else None
        lines.append(f"# {name}: {zero_impl} step against " + ", ".join(
            f"{r.impl} {zero.step_ms / r.step_ms:.3f}" for r in others) +
            (f"; the best torch ({best.impl}) {zero.step_ms / best.step_ms:.3f}" if best
             else "") +
            (f"; optimizer state {zero.state_mb / rows['pycomm'].state_mb:.3f} of pycomm's"
             if "pycomm" in rows and rows["pycomm"].state_mb > 0 else ""))
    stepped = {impl: r for impl, r in rows.items() if r.state_mb > 0 and r.copy_gb_s > 0}
    if stepped:  # AdamW: 28 bytes an element a rank steps, 8 of them its state
        fb = min(r.no_sync_fb_ms for r in rows.values())
        copy = next(iter(stepped.values())).copy_gb_s
        lines.append(
            f"# {name}: bound = forward + backward floor {fb:.1f} ms (the fastest no_sync "
            f"step less its optimizer step) + the rank's AdamW bytes (3.5 x state_MB) at copy "
            f"speed {copy:.1f} GB/s: " + ", ".join(
                f"{impl} {fb + 3.5 * r.state_mb / copy:.1f} ms (step/bound "
                f"{r.step_ms / (fb + 3.5 * r.state_mb / copy):.3f})"
                for impl, r in stepped.items()))
    eager, compiled = rows.get("pycomm"), rows.get("pycomm" + COMPILED)
    if eager is not None and compiled is not None:
        lines.append(f"# {name}: pycomm overlap compiled {compiled.overlap:.2f} vs eager "
                     f"{eager.overlap:.2f} ({compiled.overlap - eager.overlap:+.2f})")
    return lines


def _body(cfg: Config) -> tuple[str, list[Result]]:
    allocator = common.steady_allocator()  # before any model exists
    results = run(cfg)
    return format_results(cfg, results, allocator), results


def _hosts_rank(rank: int, world_size: int, cfg: Config) -> tuple[str, list[Result]]:
    """One rank of a --hosts run (pycomm/testing/hosts.py made the env:// Gloo group)."""
    torch.set_num_threads(cfg.threads)
    return _body(cfg)


def _run_on_hosts(cfg: Config, ns: argparse.Namespace) -> tuple[str, list[Result]]:
    try:  # root and iproute2 only here; the harness ships with a clone, not the wheel
        from ..testing.hosts import Hosts, available
    except ImportError as e:
        raise SystemExit(f"--hosts needs pycomm.testing, which ships with a clone of the "
                         f"repository (pip install -e .), not with the wheel: {e}") from None

    reason = available()
    if reason is not None:
        raise SystemExit(f"--hosts: this machine cannot make hosts: {reason}")
    with Hosts(ns.hosts, link_gbit=ns.link_gbit) as hosts:
        ranks = hosts.run(_hosts_rank, ranks_per_host=ns.ranks_per_host,
                          kwargs={"cfg": cfg}, timeout=3600.0, group_timeout_s=600.0)
    return ranks[0].value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--hosts", type=int, default=0,
                   help="run on this many hosts made on this machine (network namespaces "
                        "joined by a switch, pycomm/testing/hosts.py; root), Gloo across them")
    p.add_argument("--ranks-per-host", type=int, default=1, help="with --hosts (default 1)")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="with --hosts: shape each host's link to this rate with tc tbf "
                        "(default: unshaped)")
    p.add_argument("--backend", default=None, help="default: nccl with GPUs, else gloo")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where the model lives (default: the GPU under NCCL, else the CPU); "
                        "cuda with gloo puts every rank on the GPU")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    p.add_argument("--impls", default=None,
                   help=f"comma list of {tuple(IMPLS)}, timed side by side (default "
                        f"{','.join(DEFAULT_IMPLS)}; with --optimizer adamw "
                        f"{','.join(sharded.ADAMW_IMPLS)})")
    p.add_argument("--optimizer", default=Config.optimizer, choices=tuple(sharded.OPTIMIZERS),
                   help="what every implementation steps (default sgd: the step is "
                        "communication and backward; adamw adds the optimizer's memory "
                        "traffic, which sharding divides)")
    p.add_argument("--bucket-cap-mb", type=float, default=Config.bucket_cap_mb)
    p.add_argument("--clip", type=float, default=Config.clip, metavar="MAX_NORM",
                   help="clip gradients every step to this norm, each implementation with "
                        "its own clip_grad_norm_ (default: no clipping)")
    p.add_argument("--samples", type=int, default=Config.samples,
                   help=f"the MLP's batch per rank (default {Config.samples})")
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--steps", type=int, default=Config.steps, help="timed steps per rep")
    p.add_argument("--warmup", type=int, default=Config.warmup)
    p.add_argument("--threads", type=int, default=Config.threads, help="compute threads/rank")
    p.add_argument("--compile", action="store_true",
                   help="time torch.compile(ddp) of each implementation, and pycomm eager")
    p.add_argument("--compile-backend", default=Config.compile_backend,
                   help="torch.compile backend with --compile (default inductor; aot_eager "
                        "skips code generation)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--trace", default="", metavar="DIR",
                   help="write each pycomm variant's last timed steps (all ranks) as a Chrome "
                        "trace, DIR/ddp_<model>_<impl>.json (DIR made if missing)")
    bucket_sweep.add_arguments(p)


def _names(flag: str, text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(flag, f"unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                         f"choose from {', '.join(known)}")
    return names


def configure(ns: argparse.Namespace) -> Config:
    """Every check of the command line, before any rank starts (a UsageError names the
    flag)."""
    models = _names("--models", ns.models, MODELS)
    default = sharded.ADAMW_IMPLS if ns.optimizer != "sgd" else DEFAULT_IMPLS
    impls = _names("--impls", ns.impls or ",".join(default), tuple(IMPLS))
    anchors = [i for i in impls if i in sharded.ANCHORS]
    if anchors and ns.optimizer != "adamw":
        raise UsageError("--impls", f"{', '.join(anchors)} step an AdamW of their own: "
                         f"use them with --optimizer adamw, not {ns.optimizer}")
    for flag, value, low in (("--nproc", ns.nproc, 1), ("--reps", ns.reps, 1),
                             ("--steps", ns.steps, 1), ("--warmup", ns.warmup, 0),
                             ("--samples", ns.samples, 1), ("--threads", ns.threads, 0),
                             ("--hosts", ns.hosts, 0), ("--ranks-per-host", ns.ranks_per_host, 1)):
        if value < low:
            raise UsageError(flag, f"must be at least {low}, got {value}")
    for flag, value in (("--bucket-cap-mb", ns.bucket_cap_mb), ("--clip", ns.clip)):
        if value < 0 or (flag == "--bucket-cap-mb" and value == 0):
            raise UsageError(flag, f"must be positive, got {value:g}")
    for flag, path in (("--json", ns.json), ("--trace", ns.trace)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise UsageError(flag, f"cannot write {path!r}: {folder} is not a writable folder")
    if ns.trace:  # a folder of traces: made here when its parent can hold it
        if os.path.exists(ns.trace) and not os.path.isdir(ns.trace):
            raise UsageError("--trace", f"{ns.trace!r} is not a folder")
        os.makedirs(ns.trace, exist_ok=True)
    if ns.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", "cuda asked for, but torch sees no CUDA device")
    if ns.device == "cpu" and ns.backend == "nccl":
        raise UsageError("--device", "cpu with --backend nccl: NCCL reduces GPU tensors only")
    hosts = ""
    if ns.hosts:
        link = "unshaped" if ns.link_gbit is None else f"{ns.link_gbit:g} Gbit/s (tbf)"
        hosts = f"{ns.hosts} hosts x {ns.ranks_per_host} ranks, link {link}"
    return Config(models, impls, ns.bucket_cap_mb, ns.warmup, ns.reps, ns.steps, ns.threads,
                  ns.compile, ns.compile_backend, hosts, ns.samples, ns.clip, ns.trace,
                  progress=True, optimizer=ns.optimizer, device=ns.device or "")


def main(ns: argparse.Namespace) -> int:
    """0: measured; 2: bad arguments (one line naming the flag, before any rank starts)."""
    if ns.sweep_bucket_cap:
        return bucket_sweep.main(ns)
    try:
        cfg = configure(ns)
    except UsageError as e:
        print(f"pycomm-bench ddp: error: {e}", file=sys.stderr)
        return 2
    if ns.hosts:
        backend, world = "gloo", ns.hosts * ns.ranks_per_host
        text, results = _run_on_hosts(cfg, ns)
    else:
        backend, world = ns.backend or common.default_backend(ns.nproc), ns.nproc
        text, results = common.launch(_body, cfg, ns.nproc, backend, timeout_s=3600.0,
                                      threads=cfg.threads)
    print(text, flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "torch": torch.__version__,
                       "world": world, "backend": backend,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    return 0
