"""How well the replay predicts measured pycomm DDP steps at 2-4 local Gloo ranks.

    python benchmarks/overlap_validation.py [--worlds 2,3,4] [--steps 8] [--json PATH]

At each world size, in one launch: an idle all-reduce sweep fits the network
(`fit_network`, 16 B-16 MiB), then the benchmark MLP (`pycomm-bench ddp`'s, ~25M
parameters, torch's bucket layout) trains `steps` steps after warm-up; every rank's
recorded steps come back. Then, per world size n, from the median step of the slowest rank:
  idle, same n:        replay of the step recorded at n through the idle fit at n;
  in-backward, same n: through the bandwidth the *other* steps recorded at n saw
                       (`fit_in_backward`, leave-one-out; latency from the idle fit);
  idle, from 2:        replay of the step recorded at 2 ranks, at n, through the idle fit at
                       2 ranks (what a user extrapolating from a small run would do).
The error is (predicted - measured) / measured of backward (start to end of finalize) and
the absolute error of exposed communication.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

import pycomm
from pycomm.bench import common
from pycomm.bench.bucket_sweep import fit_network
from pycomm.objects import all_gather_object
from pycomm.overlap import AlphaBeta, fit_in_backward, replay, step_report


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)  # pycomm-bench ddp's "mlp": 6 x (2048 x 2048), batch 32
    layers = [m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.ReLU())]
    return nn.Sequential(*layers), torch.randn(32, 2048)


def _body(steps: int) -> dict:
    network = fit_network()
    module, x = _mlp()
    ddp = pycomm.DistributedDataParallel(module)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    for _ in range(steps + 2):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    gathered = all_gather_object(ddp.timelines(steps))
    return {"network": network.__dict__, "timelines": gathered}


def _slowest_median(timelines_by_rank: list[list[dict]]) -> tuple[dict, list[dict]]:
    """The median step (by the slowest rank's backward) and the other steps of that rank."""
    steps = list(zip(*timelines_by_rank))  # per step: one raw per rank
    slowest = [max(s, key=lambda raw: step_report(raw).backward_s) for s in steps]
    order = sorted(range(len(slowest)), key=lambda i: step_report(slowest[i]).backward_s)
    mid = order[len(order) // 2]
    return slowest[mid], [s for i, s in enumerate(slowest) if i != mid]


def _row(case: str, n: int, predicted, measured) -> dict:
    return {"case": case, "world": n, "measured_backward_ms": measured.backward_s * 1e3,
            "predicted_backward_ms": predicted.backward_s * 1e3,
            "backward_error": (predicted.backward_s - measured.backward_s) / measured.backward_s,
            "measured_exposed_ms": measured.exposed_comm_s * 1e3,
            "predicted_exposed_ms": predicted.exposed_comm_s * 1e3,
            "exposed_error_ms": (predicted.exposed_comm_s - measured.exposed_comm_s) * 1e3}


def compare(runs: dict[int, dict]) -> list[dict]:
    rows, base = [], min(runs)
    base_step, _ = _slowest_median(runs[base]["timelines"])
    for n, run in sorted(runs.items()):
        step, others = _slowest_median(run["timelines"])
        measured = step_report(step)
        idle = AlphaBeta(**run["network"])
        rows.append(_row("idle, same n", n, replay(step, idle, n), measured))
        rows.append(_row("in-backward, same n", n,
                         replay(step, fit_in_backward(others, n, idle.alpha_s), n), measured))
        if n != base:
            rows.append(_row(f"idle, from {base}", n,
                             replay(base_step, AlphaBeta(**runs[base]["network"]), n), measured))
    return rows


def format_rows(runs: dict[int, dict], rows: list[dict]) -> str:
    lines = [f"# world {n}: idle fit alpha {r['network']['alpha_s'] * 1e6:.0f} us, busbw "
             f"{r['network']['busbw_Bps'] / 1e9:.2f} GB/s" for n, r in sorted(runs.items())]
    lines.append(f"#{'case':>21} {'world':>5} {'bwd meas':>9} {'bwd pred':>9} {'err':>7} "
                 f"{'exp meas':>9} {'exp pred':>9} {'err ms':>7}")
    for r in rows:
        lines.append(f"{r['case']:>22} {r['world']:>5} {r['measured_backward_ms']:>9.1f} "
                     f"{r['predicted_backward_ms']:>9.1f} {r['backward_error']:>+7.1%} "
                     f"{r['measured_exposed_ms']:>9.1f} {r['predicted_exposed_ms']:>9.1f} "
                     f"{r['exposed_error_ms']:>+7.1f}")
    for case in dict.fromkeys(r["case"] for r in rows):
        errs = [abs(r["backward_error"]) for r in rows if r["case"] == case]
        lines.append(f"# {case}: |backward error| median {statistics.median(errs):.1%}, "
                     f"max {max(errs):.1%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    runs = {n: common.launch(_body, ns.steps, n, "gloo", timeout_s=1800.0)
            for n in (int(w) for w in ns.worlds.split(","))}
    rows = compare(runs)
    print(format_rows(runs, rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rows": rows, "networks": {n: r["network"] for n, r in runs.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
