"""What `pycomm-bench collectives` adds to the all-reduce time it reports, against a bare
`dist.all_reduce` loop timed the same way (back to back, one clock read at each end, the
slowest rank), in the same processes, interleaved repetition by repetition.

    python benchmarks/collectives_overhead.py [--nproc 2] [--reps 41] [--json PATH]

Each repetition times the tool's path (`collectives_run._measure`: the same Case, loop and
combination as the CLI) and the bare loop on a buffer of the same size, in alternating
order; the overhead is the median over repetitions of tool / bare - 1 (paired, so that a
machine shared with other jobs moves both sides of a pair together). A second bare loop in
each repetition, compared with the first the same way, shows the noise floor of the method.

On a loaded 2-core machine the 2-rank figures swing by tens of percent between repetitions,
more than the overhead being measured, so the script also isolates the tool's added time per
call: both loops again in this process with `dist.all_reduce` replaced by a function that
returns at once, so that only the loop machinery is timed (the tool's closure and arguments
against a bare call). That added time per call over the 2-rank latency is the share of the
reported time the tool itself adds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from pycomm.bench import common
from pycomm.bench.collective_ops import COLLECTIVES, IN_PLACE, Setting
from pycomm.bench.collectives_run import Config, _measure

_SIZES = (4, 64 << 10, 1 << 20)


def _bare(size: int, cfg: Config) -> float:
    t = torch.ones(size // 4)
    for _ in range(cfg.warmup):
        dist.all_reduce(t)
    begin = time.perf_counter()
    for _ in range(cfg.iters):
        dist.all_reduce(t)
    mean = torch.tensor([(time.perf_counter() - begin) / cfg.iters], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean) * 1e6


def _body(args: argparse.Namespace) -> list[dict]:
    cfg = Config(warmup=5, iters=args.iters, samples=1, check=False)
    coll, rank, world = COLLECTIVES["all_reduce"], dist.get_rank(), dist.get_world_size()
    results = []
    for size in _SIZES:
        s = Setting(rank, world, size // 4, torch.float32, torch.device("cpu"))
        times: dict[str, list[float]] = {"tool": [], "bare": [], "control": []}
        for rep in range(args.reps):
            # Alternate the order, so that no loop always follows another.
            for kind in list(times) if rep % 2 == 0 else reversed(list(times)):
                times[kind].append(_measure(coll, s, IN_PLACE, size, cfg).time_us
                                   if kind == "tool" else _bare(size, cfg))
        tool, bare, control = times["tool"], times["bare"], times["control"]
        results.append({
            "size": size, "tool_us_median": statistics.median(tool),
            "bare_us_median": statistics.median(bare),
            "overhead_median": statistics.median(a / b - 1 for a, b in zip(tool, bare)),
            # A bare loop against a bare loop, paired the same way: the noise floor.
            "control_median": statistics.median(c / b - 1 for c, b in zip(control, bare)),
            "reps": args.reps, "iters": args.iters})
    return results


def _returns_at_once(*args, **kwargs) -> None:
    return None


def _loop_cost(args: argparse.Namespace) -> dict:
    """Added time per call (us) of the tool's loop over a bare loop, collective stubbed."""
    cfg = Config(warmup=20, iters=20_000, samples=1, check=False)
    s = Setting(0, 1, 1, torch.float32, torch.device("cpu"))
    real, dist.all_reduce = dist.all_reduce, _returns_at_once
    try:
        tool, bare = [], []
        for _ in range(args.reps):
            tool.append(_measure(COLLECTIVES["all_reduce"], s, IN_PLACE, 4, cfg).time_us)
            bare.append(_bare(4, cfg))
    finally:
        dist.all_reduce = real
    return {"tool_us_median": statistics.median(tool), "bare_us_median": statistics.median(bare),
            "added_us_median": statistics.median(a - b for a, b in zip(tool, bare)),
            "reps": args.reps, "iters": cfg.iters}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=41)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = common.launch(_body, args, args.nproc, "gloo")
    one = _loop_cost(args)
    print(f"{'size (B)':>10} {'tool (us)':>10} {'bare (us)':>10} {'overhead':>9} "
          f"{'bare/bare':>9}  {'added/call':>10}")
    for r in results:
        r["added_share"] = one["added_us_median"] / r["bare_us_median"]
        print(f"{r['size']:>10} {r['tool_us_median']:>10.1f} {r['bare_us_median']:>10.1f} "
              f"{r['overhead_median']:>+9.2%} {r['control_median']:>+9.2%}  "
              f"{r['added_share']:>+10.3%}")
    print(f"loop alone (collective stubbed): tool {one['tool_us_median']:.3f} us, bare "
          f"{one['bare_us_median']:.3f} us, added {one['added_us_median']:+.3f} us per call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": date, "torch": torch.__version__,
                       "device": common.device_name("gloo"), "host": platform.node(),
                       "two_ranks": results, "loop_alone": one}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
