"""How well the alpha-beta replay predicts real Gloo collectives launched during an
emulated backward, at 2-4 local ranks.

    python benchmarks/overlap_synthetic.py [--worlds 2,3,4] [--reps 5] [--json PATH]

Each rank emulates backward with sleeps (the cores stay free for communication, unlike
real compute on a 2-core machine) and launches one async all-reduce per bucket the moment
that bucket is "ready", as the reducer does, stamping ready, launch and done (a future
callback) with the monotonic clock; then waits for all (finalize). That is a raw timeline
in the reducer's schema, so pycomm.overlap's report measures it and its replay predicts it:
  same world: the network fitted at that world size (a quick all-reduce sweep);
  scaled:     the 2-rank recording and 2-rank fit, replayed at 3 and 4 ranks (the model's
              world-size scaling, checked against the measured runs there).
Errors are (predicted - measured) / measured of the median step's backward (start of
backward to end of finalize) and the absolute error of the exposed communication.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from pycomm.bench import common
from pycomm.bench.bucket_sweep import fit_network
from pycomm.objects import all_gather_object
from pycomm.overlap import AlphaBeta, replay, step_report

MIB = 1 << 20
# (name, [(compute before the bucket is ready in ms, bucket MiB), ...])
SCENARIOS = (
    ("4 x 4 MiB, 15 ms apart", [(15, 4)] * 4),
    ("8 x 1 MiB, 2 ms apart", [(2, 1)] * 8),
    ("16 MiB at the end", [(40, 16)]),
    ("1 MiB early, 8 MiB late", [(5, 1), (30, 8)]),
)


def _one_step(plan, step: int) -> dict:
    tensors = [torch.ones(int(mib * MIB) // 4) for _, mib in plan]
    done = [-1] * len(plan)
    futures, ready, launch = [], [], []
    dist.barrier()
    start = time.monotonic_ns()
    for k, ((compute_ms, _), t) in enumerate(zip(plan, tensors)):
        time.sleep(compute_ms / 1e3)
        ready.append(time.monotonic_ns())
        launch.append(time.monotonic_ns())
        fut = dist.all_reduce(t, async_op=True).get_future()
        futures.append(fut.then(lambda _f, k=k: done.__setitem__(k, time.monotonic_ns())))
    fin_start = time.monotonic_ns()
    for f in futures:
        f.wait()
    fin_end = time.monotonic_ns()
    return {"step": step, "rank": dist.get_rank(), "backward_start_ns": start,
            "param_ready_ns": ready, "param_names": [f"p{k}" for k in range(len(plan))],
            "buckets": [{"index": k, "nbytes": t.numel() * 4, "param_indices": [k],
                         "ready_ns": ready[k], "launch_ns": launch[k], "done_ns": done[k]}
                        for k, t in enumerate(tensors)],
            "finalize_start_ns": fin_start, "finalize_end_ns": fin_end}


def _median_step(steps: list[dict]) -> dict:
    return sorted(steps, key=lambda s: step_report(s).backward_s)[len(steps) // 2]


def _body(reps: int) -> dict:
    network = fit_network()
    recorded = {}
    for name, plan in SCENARIOS:
        _one_step(plan, -1)  # warm-up
        steps = [_one_step(plan, i) for i in range(reps)]
        recorded[name] = all_gather_object(_median_step(steps))
    return {"network": network.__dict__, "steps": recorded}


def _slowest(raws: list[dict]) -> dict:
    return max(raws, key=lambda s: step_report(s).backward_s)


def _compare(label: str, n: int, raw_pred_from: dict, model: AlphaBeta, measured: dict) -> dict:
    p, m = replay(raw_pred_from, model, n), step_report(measured)
    return {"case": label, "world": n, "measured_backward_ms": m.backward_s * 1e3,
            "predicted_backward_ms": p.backward_s * 1e3,
            "backward_error": (p.backward_s - m.backward_s) / m.backward_s,
            "measured_exposed_ms": m.exposed_comm_s * 1e3,
            "predicted_exposed_ms": p.exposed_comm_s * 1e3,
            "exposed_error_ms": (p.exposed_comm_s - m.exposed_comm_s) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    runs = {n: common.launch(_body, ns.reps, n, "gloo")
            for n in (int(w) for w in ns.worlds.split(","))}
    rows, base = [], min(runs)
    for n, run in runs.items():
        model = AlphaBeta(**run["network"])
        for name, _ in SCENARIOS:
            measured = _slowest(run["steps"][name])
            rows.append(_compare(f"{name} | same world", n, measured, model, measured))
            if n != base:
                rows.append(_compare(f"{name} | from {base} ranks", n,
                                     _slowest(runs[base]["steps"][name]),
                                     AlphaBeta(**runs[base]["network"]), measured))
    for n, run in runs.items():
        net = run["network"]
        print(f"# world {n}: fitted alpha {net['alpha_s'] * 1e6:.0f} us, busbw "
              f"{net['busbw_Bps'] / 1e9:.2f} GB/s")
    print(f"#{'case':>44} {'world':>5} {'bwd meas':>9} {'bwd pred':>9} {'err':>7} "
          f"{'exp meas':>9} {'exp pred':>9} {'err ms':>7}")
    for r in rows:
        print(f"{r['case']:>45} {r['world']:>5} {r['measured_backward_ms']:>9.1f} "
              f"{r['predicted_backward_ms']:>9.1f} {r['backward_error']:>+7.1%} "
              f"{r['measured_exposed_ms']:>9.1f} {r['predicted_exposed_ms']:>9.1f} "
              f"{r['exposed_error_ms']:>+7.1f}")
    errs = [abs(r["backward_error"]) for r in rows]
    print(f"# |backward error|: median {statistics.median(errs):.1%}, max {max(errs):.1%}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
