"""Gradient clipping: pycomm.clip_grad_norm_ vs torch's clip_grad_norm_ (foreach on and off).

Single process, side by side in one run: every repetition times each method once, in
turn, on the same gradients, so ratios hold while absolute times swing on a shared host.
Cases: a GPT-2-small-like set (148 tensors, 124M elements) and 1,000 tensors of 1,024
elements; clipping active (max_norm below the norm) and inactive (far above it).
On CUDA, "pycomm-graph" is pycomm's clip captured in a CUDA graph and replayed.
Effective GB/s counts the traffic clipping needs (read once for the norm; read and
write again to scale when active), the same bytes for every method; `%copy` relates it to
a large tensor copy measured in the same run (read + write bytes / time). On CUDA the
`device` columns time the same calls between events recorded around them on the stream:
what the device spent, without the host's sync and Python. `normerr` is each
method's total norm against the float64 norm of the same gradients (relative; untimed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .. import _C
from .. import clip as pycomm_clip
from .._version import __version__

_GPT2_SMALL_LAYER = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                     (768, 3072), (3072,), (3072, 768), (768,)]


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter shapes: embeddings, 12 blocks, final layer norm."""
    return [(50257, 768), (1024, 768), *(_GPT2_SMALL_LAYER * 12), (768,), (768,)]


CASES = {"gpt2-small": gpt2_small_shapes, "1000x1024": lambda: [(1024,)] * 1000}
# max_norm relative to the norm the gradients have before each call: 0.9 clips on every call
# (the shared gradients shrink by 0.9 per call: ~0.003x after 54 calls, far from
# denormals even in half precision); 1e9 never clips.
MODES = {"active": 0.9, "inactive": 1e9}


@dataclass(frozen=True)
class Config:
    device: str = "cpu"
    cases: tuple[str, ...] = tuple(CASES)
    dtype: str = "float32"
    warmup: int = 3
    reps: int = 15
    copy_mib: int = 256
    threads: int = 0  # 0: torch's default intra-op thread count


@dataclass(frozen=True)
class Row:
    case: str
    tensors: int
    elements: int
    mode: str
    method: str
    time_us: float
    p10_us: float
    p90_us: float
    gbps: float
    frac_copy: float
    speedup_vs_foreach: float
    norm_rel_err: float
    wrong: int
    # CUDA: the median time between events recorded around the call on the stream (the
    # device's view: no host sync, no Python), and its share of the copy bandwidth timed so
    device_us: float = float("nan")
    frac_copy_device: float = float("nan")


def _holder(grad: torch.Tensor) -> torch.nn.Parameter:
    """A parameter carrying `grad`; its own storage is never written, so never paged in."""
    p = torch.nn.Parameter(torch.empty(grad.shape, dtype=grad.dtype, device=grad.device))
    p.grad = grad
    return p


def _methods() -> dict[str, Callable]:
    return {
        "pycomm": lambda ps, m: pycomm_clip.clip_grad_norm_(ps, m),
        "torch-foreach": lambda ps, m: torch.nn.utils.clip_grad_norm_(ps, m, foreach=True),
        "torch-loop": lambda ps, m: torch.nn.utils.clip_grad_norm_(ps, m, foreach=False),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(wall seconds, device seconds) of one call, synchronized before and after: on CUDA
    the device time is between events recorded around the call; nan elsewhere."""
    _sync(device)
    events = ([torch.cuda.Event(enable_timing=True) for _ in range(2)]
              if device.type == "cuda" else [])
    start = time.perf_counter()
    if events:
        events[0].record()
    fn()
    if events:
        events[1].record()
    _sync(device)
    wall = time.perf_counter() - start
    return wall, (events[0].elapsed_time(events[1]) / 1e3 if events else float("nan"))


def copy_bandwidth(cfg: Config, device: torch.device) -> tuple[float, float]:
    """GB/s of a large copy (bytes read + written), median over the repetitions: by the
    wall clock, and by the device's events (nan off CUDA)."""
    n = cfg.copy_mib * (1 << 20) // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    for _ in range(cfg.warmup):
        dst.copy_(src)
    samples = [_time(lambda: dst.copy_(src), device) for _ in range(cfg.reps)]
    nbytes = 2 * src.numel() * src.element_size()
    return (nbytes / statistics.median(s[0] for s in samples) / 1e9,
            nbytes / statistics.median(s[1] for s in samples) / 1e9)


def _grads(shapes, dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def _exact_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients, computed in float64."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double())
                                                 for g in grads]))


def norm_errors(grads: list[torch.Tensor]) -> dict[str, float]:
    """Untimed: each method's total norm of `grads` against their float64 norm, relative
    (max_norm inf: nothing is scaled, so every method sees the same values)."""
    holders = [_holder(g) for g in grads]
    exact = _exact_norm(grads).item()
    return {name: abs(fn(holders, float("inf")).double().item() - exact) / exact
            for name, fn in _methods().items()}


def _count_wrong(shapes, dtype, device, rel: float) -> int:
    """Untimed: pycomm's total norm and clipped gradients against an exact fp64 computation
    on the same inputs (torch's own fp32 norm drifts ~3e-4 on the 38M-element embedding, so
    it is not the reference here; tests/grad/test_clip.py compares against torch)."""
    grads = _grads(shapes, dtype, device, 1)
    exact = [g.double() for g in grads]
    norm = _exact_norm(grads)
    max_norm = rel * norm.item()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    total = pycomm_clip.clip_grad_norm_([_holder(g) for g in grads], max_norm)
    # fp32 accumulation over ~1e8 elements, and one rounding of each clipped element and
    # of the total (returned in the gradients' dtype, as torch's) to that dtype: half an
    # ulp, i.e. eps/2 relative, for bf16 and fp16, and half the subnormals' spacing
    # absolute (fp16's clipped ~1e-3 gradients reach its subnormals).
    info = torch.finfo(dtype)
    tol = dict(rtol=max(1e-5, info.eps), atol=info.smallest_normal * info.eps)
    wrong = sum(not torch.allclose(g.double(), e * coef, **tol) for g, e in zip(grads, exact))
    return wrong + (not torch.allclose(total.double(), norm, **tol))


def _graph_replay(grads: list[torch.Tensor], rel: float) -> Callable:
    """pycomm's clip captured in a CUDA graph and replayed (Note [Tile plans]): what a
    captured training step pays for it, host work and launches gone. It clips its own copy
    of the gradients with a max_norm fixed at capture: for an active clip 0, so that every
    replay scales (by 0: the same traffic), where a max_norm below the norm at capture
    would stop clipping once the first replay brought the norm down to it (the record of
    2026-11-27 timed its fp32 row so, as an inactive clip)."""
    holders = [_holder(g.clone()) for g in grads]
    norm = torch.nn.utils.clip_grad_norm_(holders, float("inf"), foreach=True).item()
    max_norm = 0.0 if rel < 1 else rel * norm
    pycomm_clip.clip_grad_norm_(holders, float("inf"))  # the plan, made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pycomm_clip.clip_grad_norm_(holders, max_norm)
    # The graph reads and writes the holders' gradients at every replay: they live as long
    # as the replay does (freed, their memory would be clipped as whoever reused it).
    return lambda _ps, _m, _keep=holders: graph.replay()


def rotated(items: list, rep: int) -> list:
    """The methods of repetition `rep`, rotated by one each repetition: each runs first,
    and right after each other, equally often. A method always run after torch's
    multi-threaded calls would find OpenMP's workers still spinning on the other cores."""
    k = rep % len(items)
    return items[k:] + items[:k]


def run_case(cfg: Config, case: str, copy_gbps: tuple[float, float]) -> list[Row]:
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    shapes = CASES[case]()
    grads = _grads(shapes, dtype, device, 0)
    holders = [_holder(g) for g in grads]
    elements = sum(g.numel() for g in grads)
    nbytes = elements * grads[0].element_size()
    errors = norm_errors(grads)  # before timing: the gradients as generated
    rows = []
    for mode, rel in MODES.items():
        norm = torch.nn.utils.clip_grad_norm_(holders, float("inf"), foreach=True).item()
        methods = list(_methods().items())
        if device.type == "cuda":
            methods.append(("pycomm-graph", _graph_replay(grads, rel)))
            errors["pycomm-graph"] = errors["pycomm"]  # the same kernels, replayed
        samples = {name: [] for name, _ in methods}
        for rep in range(cfg.warmup + cfg.reps):  # interleaved: every method once per rep
            for name, fn in rotated(methods, rep):
                sec = _time(lambda fn=fn, m=rel * norm: fn(holders, m), device)  # (wall, dev)
                if name != "pycomm-graph":  # which clips a copy of its own
                    norm = min(norm, rel * norm)  # the norm the next call sees
                if rep >= cfg.warmup:
                    samples[name].append(sec)
        traffic = nbytes * (3 if mode == "active" else 1)
        wrong = _count_wrong(shapes, dtype, device, rel)
        base = statistics.median(w for w, _ in samples["torch-foreach"])
        for name, both in samples.items():
            s = [w for w, _ in both]
            q = statistics.quantiles(s, n=10)
            med = statistics.median(s)
            dev = statistics.median(d for _, d in both)
            gbps = traffic / med / 1e9
            rows.append(Row(case, len(shapes), elements, mode, name, med * 1e6, q[0] * 1e6,
                            q[-1] * 1e6, gbps, gbps / copy_gbps[0], base / med, errors[name],
                            wrong if name == "pycomm" else 0, dev * 1e6,
                            traffic / dev / 1e9 / copy_gbps[1]))
    return rows


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads,"
            f" pycomm {_C._cpu_kernels()} loops)")


def run(cfg: Config) -> tuple[tuple[float, float], list[Row]]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)  # for torch's kernels and pycomm's alike
    device = torch.device(cfg.device)
    copy_gbps = copy_bandwidth(cfg, device)
    return copy_gbps, [r for case in cfg.cases for r in run_case(cfg, case, copy_gbps)]


def _or_dash(value: float, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}{fmt}}"


def report(cfg: Config, copy_gbps: tuple[float, float], rows: list[Row]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"# pycomm {__version__} | torch {torch.__version__}"
        f" | {_device_name(torch.device(cfg.device))} | {now:%Y-%m-%d %H:%M} UTC",
        f"# clip_grad_norm_ | dtype {cfg.dtype} | warmup {cfg.warmup} | reps {cfg.reps}"
        f" (interleaved) | copy bandwidth {copy_gbps[0]:.2f} GB/s ({cfg.copy_mib} MiB copy"
        + (f"; {copy_gbps[1]:.2f} GB/s by the device's events)" if not math.isnan(copy_gbps[1])
           else ")"),
        f"#{'case':>11} {'tensors':>8} {'elements':>10} {'clip':>9} {'method':>14} {'time':>10}"
        f" {'p10':>10} {'p90':>10} {'GB/s':>7} {'%copy':>6} {'vs foreach':>10} {'normerr':>8}"
        f" {'#wrong':>6} {'device':>9} {'%copy':>6}",
        f"#{'':>11} {'':>8} {'':>10} {'':>9} {'':>14} {'(us)':>10} {'(us)':>10} {'(us)':>10}"
        f" {'':>7} {'':>6} {'(x)':>10} {'(rel)':>8} {'':>6} {'(us)':>9} {'(dev)':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r.case:>12} {r.tensors:>8} {r.elements:>10} {r.mode:>9} {r.method:>14}"
            f" {r.time_us:>10.1f} {r.p10_us:>10.1f} {r.p90_us:>10.1f} {r.gbps:>7.2f}"
            f" {100 * r.frac_copy:>5.1f}% {r.speedup_vs_foreach:>10.2f} {r.norm_rel_err:>8.1e}"
            f" {r.wrong:>6} {_or_dash(r.device_us, '.1f', 9)}"
            f" {_or_dash(100 * r.frac_copy_device, '.1f', 5)}"
            f"{'' if math.isnan(r.device_us) else '%'}")
    lines.append(f"# Out of bounds values : {sum(r.wrong for r in rows)} "
                 f"{'OK' if not any(r.wrong for r in rows) else 'FAILED'}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--case", action="append", choices=list(CASES), help="repeatable; default all")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--warmup", type=int, default=Config.warmup)
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads for every method (default: torch's)")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")


def main(ns: argparse.Namespace) -> int:
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Config(device=device, cases=tuple(ns.case or CASES), dtype=ns.dtype, reps=ns.reps,
                 warmup=ns.warmup, threads=ns.threads)
    copy_gbps, rows = run(cfg)
    print(report(cfg, copy_gbps, rows))
    if ns.json:
        with open(ns.json, "w") as f:
            def plain(x):  # nan (no device timing off CUDA) as JSON's null
                return None if isinstance(x, float) and math.isnan(x) else x

            json.dump({"config": asdict(cfg), "copy_gbps": copy_gbps[0],
                       "copy_gbps_device": plain(copy_gbps[1]),
                       "rows": [{k: plain(v) for k, v in asdict(r).items()} for r in rows]},
                      f, indent=1)
    return 0
