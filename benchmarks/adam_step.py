"""One AdamW step on CPU, side by side: pycomm's one-pass step (pycomm.optim.AdamW, torch's
for-loop bits), torch's fused=True kernel (the fastest CPU AdamW torch has, not its
for-loop's bits), torch's for-loop (its CPU default) and foreach steps, and a copy of the
same bytes (the bound: an AdamW step reads param, grad and both moments and writes param
and both moments, 28 bytes an element; the copy moves 3.5 floats an element, 14 read and
14 written).

Each size is `total` float32 elements in 8 parameters of equal size (a model's mix of
large tensors), every implementation stepping its own copy of the same start; timed
blocks interleaved (the order reversed every block), medians. Also the one-pass step with
its square roots through ATen's call (route "aten": Note [Adam in chunks, two at a time]
in csrc/grad/adam_cpu.cpp), where MKL's is called directly by default.

    python benchmarks/adam_step.py --json benchmarks/results/adam_step_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time

import torch

import pycomm

IMPLS = ("pycomm", "pycomm_aten_sqrt", "torch_fused", "torch_forloop", "torch_foreach", "copy")
BYTES_PER_ELEMENT = 28


def _optimizer(impl: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    options = {"lr": 1e-3, "weight_decay": 0.01}
    if impl.startswith("pycomm"):
        return pycomm.optim.AdamW(params, **options)
    flag = {"torch_fused": "fused", "torch_foreach": "foreach"}.get(impl)
    return torch.optim.AdamW(params, **options, **({flag: True} if flag else {"foreach": False}))


class Case:
    """One implementation's tensors and step at one size."""

    def __init__(self, impl: str, total: int, generator: torch.Generator) -> None:
        self.impl = impl
        n = total // 8
        if impl == "copy":
            self.src = torch.randn(total * 7 // 2, generator=generator)
            self.dst = torch.empty_like(self.src)
            return
        self.params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for _ in range(8)]
        for p in self.params:
            p.grad = torch.randn(n, generator=generator)
            p.grad[: n // 8] = 0.0  # units that never fired: exp_avg_sq stays zero there
        self.opt = _optimizer(impl, self.params)
        self.step()  # the state made

    def step(self) -> None:
        if self.impl == "copy":
            self.dst.copy_(self.src)
            return
        route = pycomm._C._adam_route("aten" if self.impl == "pycomm_aten_sqrt" else "auto")
        assert self.impl != "pycomm" or route == "mkl" or os.environ.get("PYCOMM_BENCH_ANY_ROUTE")
        self.opt.step()


def run(totals: list[int], threads: list[int], reps: int, impls: tuple[str, ...]) -> list[dict]:
    rows = []
    for nthreads in threads:
        torch.set_num_threads(nthreads)
        for total in totals:
            generator = torch.Generator().manual_seed(0)
            cases = [Case(impl, total, generator) for impl in impls]
            times: dict[str, list[float]] = {c.impl: [] for c in cases}
            for rep in range(reps):
                order = cases if rep % 2 == 0 else cases[::-1]
                for case in order:
                    start = time.perf_counter()
                    case.step()
                    times[case.impl].append(time.perf_counter() - start)
            for impl, samples in times.items():
                ms = statistics.median(samples[1:]) * 1e3
                rows.append({"threads": nthreads, "elements": total, "impl": impl, "ms": ms,
                             "gb_s": total * BYTES_PER_ELEMENT / ms / 1e6})
            pycomm._C._adam_route("auto")
    return rows


def fused_bits(total: int = 10 << 20, steps: tuple[int, ...] = (1, 10)) -> list[dict]:
    """How far torch's fused=True AdamW is from its for-loop (whose bits pycomm's step
    keeps): the share of parameters that differ, and the largest difference, after each
    number of steps from the same start with the same gradients."""
    out = []
    for n_steps in steps:
        generator = torch.Generator().manual_seed(0)
        a = torch.nn.Parameter(torch.randn(total, generator=generator))
        b = torch.nn.Parameter(a.detach().clone())
        loop = torch.optim.AdamW([a], lr=1e-3, foreach=False)
        fused = torch.optim.AdamW([b], lr=1e-3, fused=True)
        for _ in range(n_steps):
            grad = torch.randn(total, generator=generator)
            a.grad, b.grad = grad, grad.clone()
            loop.step()
            fused.step()
        out.append({"steps": n_steps, "elements": total,
                    "differ_pct": (a != b).double().mean().item() * 100,
                    "max_abs_diff": (a - b).abs().max().item()})
    return out


def format_rows(rows: list[dict]) -> str:
    lines = [f"#{'threads':>7} {'elements':>9} {'impl':>17} {'ms':>8} {'GB/s':>6} "
             f"{'/fused':>7} {'/copy':>6}"]
    for r in rows:
        same = {x["impl"]: x for x in rows
                if x["threads"] == r["threads"] and x["elements"] == r["elements"]}
        fused = same.get("torch_fused", {}).get("ms", float("nan"))
        copy = same.get("copy", {}).get("ms", float("nan"))
        lines.append(f"{r['threads']:>8} {r['elements'] / 2**20:>8.0f}M {r['impl']:>17} "
                     f"{r['ms']:>8.2f} {r['gb_s']:>6.1f} {r['ms'] / fused:>7.3f} "
                     f"{r['ms'] / copy:>6.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-m", default="1,4,16,32",
                   help="total elements per step, in Mi elements (comma-separated)")
    p.add_argument("--threads", default="1,2", help="torch threads (comma-separated)")
    p.add_argument("--reps", type=int, default=15, help="timed steps per implementation")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--json", help="write the rows, the load and the commit here")
    ns = p.parse_args()
    impls = tuple(ns.impls.split(","))
    unknown = set(impls) - set(IMPLS)
    if unknown:
        p.error(f"--impls: unknown {sorted(unknown)}; choose from {', '.join(IMPLS)}")
    load = os.getloadavg()
    rows = run([int(m) << 20 for m in ns.sizes_m.split(",")],
               [int(t) for t in ns.threads.split(",")], ns.reps, impls)
    print(f"# AdamW step on CPU (float32), medians | pycomm {pycomm.__version__} | torch "
          f"{torch.__version__} | reps {ns.reps} | cpu kernels {pycomm._C._cpu_kernels()} | "
          f"route {pycomm._C._adam_route()} | load {load[0]:.2f}")
    print(format_rows(rows))
    bits = fused_bits()
    for b in bits:
        print(f"# fused=True against the for-loop, {b['elements'] / 2**20:.0f}M parameters after "
              f"{b['steps']} step(s): {b['differ_pct']:.3f}% differ, the largest by "
              f"{b['max_abs_diff']:.1e}")
    if ns.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(ns.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "commit": commit, "torch": torch.__version__,
                "load_before": load, "load_after": os.getloadavg(), "rows": rows,
                "fused_bits": bits}, f, indent=1)


if __name__ == "__main__":
    main()
