"""Overlap on the GPU, measured twice over: pycomm's own per-bucket report, and a
torch.profiler trace of the device's streams.

Two Gloo ranks share one GPU (the one-GPU stand-in for data parallelism across GPUs): Gloo
reduces a CUDA bucket by copying it to the host on a stream of its own, summing on the
CPU and copying back, while the rank's backward goes on computing on its compute stream.
The question is whether those copies run under the backward's kernels. Rank 0 profiles
its last synchronized steps; the script reads the trace's device events by stream and
reports, per stream, busy time and how much of the copies' time lies under compute-stream
kernels. The per-bucket report (ready, launch, done against backward's end) comes from
ddp.step_reports() for the same steps. An NCCL group of one rank (--backend nccl --nproc
1) runs the same model through the in-place path (Note [One rank reduces nothing]): no
bucket work at all, the baseline of the step.

    python benchmarks/gpu_overlap.py --out DIR     # DIR/gpu_overlap.md, .json, trace

Needs a CUDA device and pycomm's CUDA build (tools/gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pycomm
from pycomm.bench.models import build_model
from pycomm.overlap import format_report

STEPS, WARMUP, TIMED = 3, 3, 10


def _intervals(events, stream):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["args"].get("stream") == stream)


def _union(intervals):
    merged = []
    for a, b in intervals:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _covered(intervals, cover):
    """Length of `intervals` (their union) lying under the union of `cover`."""
    total, cover = 0.0, _union(cover)
    for a, b in _union(intervals):
        for c, d in cover:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def streams_summary(trace: dict) -> dict:
    """Per device stream of the trace: kernels' and copies' busy time (us); for every stream
    but the compute one, how much of its copies lie under compute kernels."""
    dev = [e for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = {}
    for e in dev:
        kernels.setdefault(e["args"].get("stream"), []).append(e)
    compute = max(kernels, key=lambda s: sum(e["dur"] for e in kernels[s]
                                             if e["cat"] == "kernel"))
    compute_k = _intervals([e for e in dev if e["cat"] == "kernel"], compute)
    out = {"compute_stream": compute, "streams": {}}
    for s, events in sorted(kernels.items(), key=lambda kv: str(kv[0])):
        copies = [e for e in events if e["cat"] == "gpu_memcpy"]
        copy_iv = _intervals(copies, s)
        busy = sum(b - a for a, b in _union(_intervals(events, s)))
        row = {"events": len(events), "busy_us": round(busy, 1),
               "copies": len(copies), "copy_us": round(sum(b - a for a, b in _union(copy_iv)), 1)}
        if s != compute:
            row["copy_under_compute_us"] = round(_covered(copy_iv, compute_k), 1)
        out["streams"][str(s)] = row
    return out


def _rank(rank: int, world: int, backend: str, port: int, out: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    kw = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    module, x = build_model("mlp", samples=256)
    module, x = module.cuda(), x.cuda()
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(module), device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)

    def step():
        opt.zero_grad(set_to_none=True)
        ddp(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(TIMED):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    reports = ddp.step_reports(STEPS)
    if rank == 0:
        path = os.path.join(out, f"gpu_overlap_{backend}{world}_trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            summary = streams_summary(json.load(f))
        q.put({"backend": backend, "world": world, "step_ms": statistics.median(times),
               "reports": [format_report(r) for r in reports],
               "buckets_in_place": [b["in_place"] for b in ddp.timelines(1)[0]["buckets"]],
               "streams": summary, "trace": os.path.basename(path)})
    dist.barrier()
    dist.destroy_process_group()


def run(backend: str, world: int, out: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29600 + world + (10 if backend == "nccl" else 0)
    procs = [ctx.Process(target=_rank, args=(r, world, backend, port, out, q))
             for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=300)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"gpu_overlap: a {backend} rank exited with {p.exitcode}")
    return result


def markdown(results: list[dict]) -> str:
    lines = ["# Overlap on the GPU: the reducer's report and the device's streams", "",
             f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, pycomm "
             f"{pycomm.__version__}; the bench MLP (25.2M parameters, 256 samples per rank), "
             f"SGD; {STEPS} profiled steps after {WARMUP} + {TIMED} timed ones.", ""]
    for r in results:
        s = r["streams"]
        lines += [f"## {r['backend']}, {r['world']} rank(s) on one GPU", "",
                  f"- step (median of {TIMED}): {r['step_ms']:.2f} ms",
                  f"- buckets reduced in place: {r['buckets_in_place']}",
                  f"- trace: `{r['trace']}` (chrome://tracing, Perfetto)", "",
                  "| stream | events | busy (us) | copies | copy time (us) | "
                  "copies under compute kernels (us) |", "|---|---|---|---|---|---|"]
        for name, row in s["streams"].items():
            tag = " (compute)" if name == str(s["compute_stream"]) else ""
            lines.append(f"| {name}{tag} | {row['events']} | {row['busy_us']} | "
                         f"{row['copies']} | {row['copy_us']} | "
                         f"{row.get('copy_under_compute_us', '')} |")
        report = r["reports"][-1] if r["reports"] else "(none)"
        # indented, not fenced: gpu_check quotes this output inside a fence of its own
        lines += ["", "Per-bucket report, last profiled step, rank 0:", "",
                  *("    " + ln for ln in report.splitlines()), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the record and the traces")
    ns = p.parse_args(argv)
    if not torch.cuda.is_available() or not pycomm._C.cuda:
        print("gpu_overlap: needs a CUDA device and pycomm's CUDA build", file=sys.stderr)
        return 2
    os.makedirs(ns.out, exist_ok=True)
    results = [run("gloo", 2, ns.out), run("nccl", 1, ns.out)]
    with open(os.path.join(ns.out, "gpu_overlap.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = markdown(results)
    with open(os.path.join(ns.out, "gpu_overlap.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
