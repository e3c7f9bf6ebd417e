"""What recording the per-step timeline costs: pycomm DDP with record_timeline on and off,
side by side in the same processes.

    python benchmarks/overlap_overhead.py [--reps 15] [--steps 4] [--json PATH]

Two measurements:
  benchmark model, 2 Gloo ranks: `pycomm-bench ddp`'s ~25M-parameter MLP, one wrapper
    recording and one not, alternating `steps` steps each for `reps` repetitions; the
    overhead is the median over repetitions of on / off - 1 (paired, so that a machine
    shared with other jobs moves both sides together). On a loaded 2-core machine this
    swings by tens of percent, far more than the cost it looks for.
  recording cost, 1 rank: 200 tiny layers (400 parameters: one clock read and store each,
    three per bucket, one ring push per step), where a step is a few milliseconds; blocks
    of steps alternate on/off and the cost is the difference of the *fastest* blocks (the
    least disturbed by other jobs) and of the medians. That cost per step, over the
    benchmark MLP's step time, bounds the overhead there (the MLP has 12 parameters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import pycomm
from pycomm.bench import common


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # pycomm-bench ddp's "mlp": 6 x (2048 x 2048), ~25M parameters
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.ReLU())])


def _many_tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)])


def _time_steps(ddp, opt, x, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return (time.perf_counter() - start) / steps


def _paired(make, batch, reps: int, steps: int) -> dict:
    """Alternate blocks of `steps` steps with recording on and off; slowest rank per block."""
    x = torch.randn(*batch)
    sides = {}
    for on in (True, False):
        ddp = pycomm.DistributedDataParallel(make(), config=pycomm.DDPConfig(record_timeline=on))
        sides[on] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-6))
        _time_steps(*sides[on], x, 2)
    on_s, off_s = [], []
    for rep in range(reps):
        for on in ((True, False) if rep % 2 else (False, True)):
            t = torch.tensor([_time_steps(*sides[on], x, steps)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            (on_s if on else off_s).append(t.item())
    ratios = [a / b - 1 for a, b in zip(on_s, off_s)]
    return {"on_ms": statistics.median(on_s) * 1e3, "off_ms": statistics.median(off_s) * 1e3,
            "paired_overhead": statistics.median(ratios),
            "median_cost_us": (statistics.median(on_s) - statistics.median(off_s)) * 1e6,
            "min_cost_us": (min(on_s) - min(off_s)) * 1e6,
            "params": sum(1 for _ in sides[True][0].parameters())}


def _body(args: tuple) -> tuple[str, dict]:
    which, reps, steps = args
    if which == "mlp":
        r = _paired(_mlp, (32, 2048), reps, steps)
    else:
        r = _paired(_many_tiny, (4, 8), reps * 8, steps * 10)
    return common.header(f"timeline recording overhead, {which}", reps=reps, steps=steps,
                         ranks="max", threads=1), r


def _line(name: str, r: dict) -> str:
    return (f"{name:>16}: {r['params']:>4} params | on {r['on_ms']:8.2f} ms | off "
            f"{r['off_ms']:8.2f} ms | paired on/off - 1 {r['paired_overhead']:+.2%} | on - off: "
            f"medians {r['median_cost_us']:+.1f} us, fastest {r['min_cost_us']:+.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    head, big = common.launch(_body, ("mlp", ns.reps, ns.steps), 2, "gloo")
    _, tiny = common.launch(_body, ("tiny", ns.reps, ns.steps), 1, "gloo")
    bound = max(tiny["min_cost_us"], tiny["median_cost_us"], 0) / (big["off_ms"] * 1e3)
    print(head)
    print(_line("benchmark MLP", big) + "  (2 ranks)")
    print(_line("200 tiny layers", tiny) + "  (1 rank)")
    print(f"# recording cost (the larger of the tiny model's two estimates) over the MLP's "
          f"step: {bound:.4%}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"benchmark_mlp": big, "many_tiny": tiny, "bound": bound}, f, indent=1)


if __name__ == "__main__":
    main()
