"""Where a DDP step's CPU goes, thread by thread: pycomm's DDP on `pycomm-bench ddp`'s models,
2 local Gloo ranks (gradients over the shared-memory backend), synchronized steps against
the same steps under no_sync, and the all-reduce alone on the same gradients.

    python benchmarks/ddp_cpu_by_thread.py [--models mlp,transformer_b1] [--steps 12]

Per model and rank 0:
  threads   CPU per step of each thread that used more than 0.5 ms (/proc/self/task/*/
            schedstat): the backward thread, pycomm's communication thread, Gloo's loop;
            synchronized and in no_sync, the difference being what communication costs
            each thread.
  stats     pycomm.shm.stats() per synchronized step: collectives run, waits, how they
            ended (spun or slept), and the adaptive spin budget at the end.
  gc        Python garbage collections during the synchronized steps (gc.callbacks).
  alone     CPU per all-reduce of the model's gradients, back to back after a barrier,
            medians of `--reps`: as pieces (the in-place path, scaled by 1/world as
            read) and through one buffer holding the same bytes (dist.all_reduce).
On a 2-core machine with 2 ranks every core computes, so the step is as long as its CPU:
the synchronized step's CPU over no_sync's is the step over its floor.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

import pycomm
import pycomm.shm
from pycomm.bench import common
from pycomm.bench.models import build_model


def _thread_cpu_ns() -> dict[str, int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[f"{name}:{tid}"] = int(f.read().split()[0])
        except OSError:  # the thread ended
            pass
    return out


def _per_step(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, float]:
    per = {k: (v - before.get(k, 0)) / steps / 1e6 for k, v in after.items()}
    return {k: round(v, 1) for k, v in per.items() if v > 0.5}


def _steps(ddp, opt, x, steps: int, no_sync: bool) -> tuple[float, dict[str, float]]:
    before, cpu = _thread_cpu_ns(), time.process_time()
    for _ in range(steps):
        dist.barrier()
        opt.zero_grad()
        if no_sync:
            with ddp.no_sync():
                ddp(x).float().square().mean().backward()
        else:
            ddp(x).float().square().mean().backward()
        opt.step()
    return (time.process_time() - cpu) / steps * 1e3, _per_step(before, _thread_cpu_ns(), steps)


def _alone(module, group, reps: int) -> tuple[float, float]:
    grads = [torch.randn_like(p) for p in module.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    backend = group._get_backend(torch.device("cpu"))
    scale = 1.0 / dist.get_world_size(group)
    cpu = {"pieces": [], "buffer": []}
    for rep in range(reps):
        for kind in (("pieces", "buffer") if rep % 2 == 0 else ("buffer", "pieces")):
            dist.barrier(group=group)
            start = time.process_time()
            if kind == "pieces":
                backend.allreduce_pieces(grads, scale)
            else:
                dist.all_reduce(flat, group=group)
            cpu[kind].append((time.process_time() - start) * 1e3)
    return statistics.median(cpu["pieces"]), statistics.median(cpu["buffer"])


def body(args: argparse.Namespace) -> str:
    common.steady_allocator()
    lines = []
    for name in args.models.split(","):
        module, x = build_model(name, args.samples)
        ddp = pycomm.DistributedDataParallel(module)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
        for _ in range(3):
            _steps(ddp, opt, x, 1, False)
        collections: list[int] = []

        def count(phase: str, info: dict, seen: list[int] = collections) -> None:
            if phase == "start":
                seen.append(info["generation"])

        gc.callbacks.append(count)
        stats0 = pycomm.shm.stats(ddp.gradient_group)
        cpu, threads = _steps(ddp, opt, x, args.steps, False)
        stats1 = pycomm.shm.stats(ddp.gradient_group)
        gc.callbacks.remove(count)
        cpu_ns, threads_ns = _steps(ddp, opt, x, args.steps, True)
        stats = {k: round((stats1[k] - stats0[k]) / args.steps, 1) for k in stats1
                 if k != "spin_budget_ns" and stats1[k] != stats0[k]}
        pieces, buffer = _alone(module, ddp.gradient_group, args.reps)
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        lines += [f"{name} ({len(list(module.parameters()))} gradients, {nbytes / 1e6:.1f} MB), "
                  f"rank {dist.get_rank()}, ms per step:",
                  f"  process CPU {cpu:.1f} synchronized, {cpu_ns:.1f} in no_sync "
                  f"(+{cpu - cpu_ns:.1f})",
                  f"  threads synchronized {threads}",
                  f"  threads no_sync      {threads_ns}",
                  f"  stats per step {stats}, spin budget {stats1['spin_budget_ns']} ns",
                  f"  gc collections during the synchronized steps: {len(collections)}",
                  f"  alone: all-reduce of these gradients, CPU per call, medians of "
                  f"{args.reps}: pieces {pieces:.1f} ms, one buffer {buffer:.1f} ms"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,transformer_b1")
    p.add_argument("--samples", type=int, default=32, help="the MLP's batch per rank")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=12, help="all-reduces of each kind, alone")
    args = p.parse_args()
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} | load {load} | "
          f"pycomm {pycomm.__version__} | torch {torch.__version__} | 2 ranks, 1 thread each",
          flush=True)
    print(common.launch(body, args, 2, "gloo", timeout_s=900.0, threads=1))
    print(f"# end load {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
