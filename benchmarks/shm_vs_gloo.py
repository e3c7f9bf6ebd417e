"""All-reduce latency and bus bandwidth of the "pycomm" shared-memory backend against Gloo,
side by side in one run: both groups live in the same rank processes and each size is
measured alternately on one and the other, `--reps` times; the figure per size is the
median over repetitions of the per-iteration time (max over ranks). Alternating keeps the
ratio meaningful on a shared, noisy machine. With --md it also writes the Markdown record:
the command first, the machine's load (`uptime`) before and after, the table, and issue
7's targets checked row by row.

    python benchmarks/shm_vs_gloo.py --nproc 2 --reps 9 \
        --json benchmarks/results/shm_allreduce_2ranks_cpu.json \
        --md benchmarks/results/shm_allreduce_2ranks_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pycomm

_SIZES = [4 << (2 * i) for i in range(14)]  # 4 B .. 256 MiB, factor 4
# Issue 7's targets at 2 ranks: latency ratio up to this size, busbw ratio from 1 MiB up.
_LATENCY_TARGET, _LATENCY_UP_TO = 10.0, 64 << 10
_BUSBW_TARGET, _BUSBW_FROM = 5.0, 1 << 20


def _iters(size: int) -> tuple[int, int]:
    """(warm-up, timed) iterations: about 50 ms of Gloo time per measurement at most."""
    if size <= 64 << 10:
        return 20, 200
    if size <= 4 << 20:
        return 3, 20
    return 1, 3


def _time(t: torch.Tensor, group, iters: int, warmup: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per iteration, max over ranks. CPU time counts every
    thread of the process (Gloo's I/O threads too) and is what the collective costs a
    machine whose cores are shared; wall time is what a rank waits."""
    for _ in range(warmup):
        dist.all_reduce(t, group=group)
    dist.barrier(group=group)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    spent = torch.tensor([time.perf_counter() - start, time.process_time() - cpu],
                         dtype=torch.float64) / iters
    dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=group)
    return spent[0].item(), spent[1].item()


def _check(group, world: int) -> None:
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=group)
    assert torch.all(t == world * (world + 1) / 2), "wrong all-reduce result"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _body(rank: int, nproc: int, store_path: str, reps: int, out: str | None,
          md: str | None) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, nproc)
    dist.init_process_group("pycomm", store=store, rank=rank, world_size=nproc,
                            timeout=datetime.timedelta(seconds=300))
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    for g in groups.values():
        _check(g, nproc)
    rows, load_before, uptime_before = [], os.getloadavg(), _uptime()
    for size in _SIZES:
        t = torch.ones(size // 4)
        warmup, iters = _iters(size)
        samples = {name: [] for name in groups}
        for _ in range(reps):
            for name, g in groups.items():
                samples[name].append(_time(t, g, iters, warmup))
        row = {"size": size, "count": size // 4}
        for name, s in samples.items():
            sec = statistics.median(w for w, _ in s)
            algbw = size / sec / 1e9
            row[name] = {"time_us": sec * 1e6, "cpu_us": statistics.median(c for _, c in s) * 1e6,
                         "algbw": algbw, "busbw": algbw * 2 * (nproc - 1) / nproc}
        rows.append(row)
        if rank == 0:
            _print_row(row)
    if rank == 0 and (out or md):
        command = f"PYTHONPATH=. python benchmarks/shm_vs_gloo.py --nproc {nproc} --reps {reps}"
        command += (f" --json {out}" if out else "") + (f" --md {md}" if md else "")
        meta = {"command": command,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "host": platform.node(), "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(), "torch": torch.__version__,
                "pycomm": pycomm.__version__, "world": nproc, "dtype": "float32",
                "op": "sum", "reps": reps, "statistic": "median over reps of mean per-iteration "
                "time, max over ranks", "machine_shared": True,
                "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
                "uptime_before_after": [uptime_before, _uptime()], "rows": rows}
        if out:
            with open(out, "w") as f:
                json.dump(meta, f, indent=1)
        if md:
            with open(md, "w") as f:
                f.write(_markdown(meta))
    dist.destroy_process_group()


def _header() -> str:
    return (f"#{'size(B)':>10} {'pycomm':>10} {'gloo':>10} {'ratio':>8} {'busbw':>8} "
            f"{'gloo':>8} {'pycomm':>10} {'gloo':>10} {'ratio':>8}\n"
            f"#{'':>10} {'wall(us)':>10} {'wall(us)':>10} {'':>8} {'(GB/s)':>8} {'(GB/s)':>8} "
            f"{'cpu(us)':>10} {'cpu(us)':>10} {'':>8}")


def _verdicts(rows: list[dict]) -> list[str]:
    """Issue 7's targets, one line per measured size they cover."""
    lines = []
    for row in rows:
        ratio = row["gloo"]["time_us"] / row["pycomm"]["time_us"]
        if row["size"] <= _LATENCY_UP_TO:
            target, what = _LATENCY_TARGET, "latency"
        elif row["size"] >= _BUSBW_FROM:
            target, what = _BUSBW_TARGET, "busbw"
        else:
            continue
        verdict = "met" if ratio >= target else "NOT met"
        lines.append(f"- {row['size']:>9} B: {what} {ratio:.1f}x Gloo (target >= "
                     f"{target:.0f}x): {verdict}")
    return lines


def _markdown(meta: dict) -> str:
    table = "\n".join(_format_row(r) for r in meta["rows"])
    return (f"# Shared-memory backend vs Gloo all-reduce, {meta['world']} ranks "
            f"({meta['date']})\n\nRerun:\n\n```\n{meta['command']}\n```\n\n"
            f"Machine: {meta['cores']} CPU cores ({meta['cpu']}), torch {meta['torch']}, "
            f"pycomm {meta['pycomm']}; shared with other work.\n\n"
            f"`uptime` before: `{meta['uptime_before_after'][0]}`\n\n"
            f"`uptime` after: `{meta['uptime_before_after'][1]}`\n\n"
            f"Statistic: {meta['statistic']}; ratio = Gloo time / pycomm time (the busbw "
            f"ratio too).\n\n```\n{_title(meta['world'], meta['reps'])}\n{_header()}\n"
            f"{table}\n```\n\nTargets (issue 7, at 2 ranks):\n\n"
            + "\n".join(_verdicts(meta["rows"])) + "\n")


def _title(nproc: int, reps: int) -> str:
    return (f"# all_reduce float32 sum | world {nproc} | reps {reps} | torch "
            f"{torch.__version__} | pycomm {pycomm.__version__}")


def _print_row(row: dict) -> None:
    print(_format_row(row), flush=True)


def _format_row(row: dict) -> str:
    p, g = row["pycomm"], row["gloo"]
    return (f"{row['size']:>11} {p['time_us']:>10.1f} {g['time_us']:>10.1f} "
          f"{g['time_us'] / p['time_us']:>7.1f}x {p['busbw']:>8.3f} {g['busbw']:>8.3f} "
          f"{p['cpu_us']:>10.1f} {g['cpu_us']:>10.1f} {g['cpu_us'] / p['cpu_us']:>7.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the Markdown record here")
    ns = ap.parse_args()
    print(_title(ns.nproc, ns.reps))
    print(_header())
    with tempfile.TemporaryDirectory(prefix="pycomm-shm-bench-") as tmp:
        mp.start_processes(_body, nprocs=ns.nproc, start_method="spawn",
                           args=(ns.nproc, os.path.join(tmp, "store"), ns.reps, ns.json, ns.md))


if __name__ == "__main__":
    main()
