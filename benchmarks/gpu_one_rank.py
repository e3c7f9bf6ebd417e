"""A one-GPU DDP step against the module alone: torch's DDP, pycomm's DDP (with and
without its per-step timeline) and the bare module (no wrapper) on an NCCL group of one
rank, the same model and batch, blocks of steps interleaved, medians. On one rank pycomm
reduces every bucket in place (Note [One rank reduces nothing]): its step should cost what
the module's costs.

    python benchmarks/gpu_one_rank.py [--json PATH] [--profile PATH]

--profile writes, for the MLP, torch.profiler's host-side table (self CPU time by
operator and CUDA runtime call, with counts) of the bare module's steps and pycomm's, so
that what the wrapper adds per step can be read call by call.
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
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm.bench.models import build_model

REPS, STEPS = 40, 5


def profile_host(step, keys, path, steps: int = 50) -> None:
    """torch.profiler's self-CPU table of `steps` steps of each model in `keys`."""
    from torch.profiler import ProfilerActivity, profile

    with open(path, "w") as f:
        for k in keys:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step(k)
                torch.cuda.synchronize()
            f.write(f"## {k}: {steps} steps\n\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40,
                                              max_name_column_width=60))
            f.write("\n\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None,
                   help="write the MLP's host-side profile (bare and pycomm) to this file")
    ns = p.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rows = []
    for name in ("mlp", "transformer"):
        module, x = build_model(name, samples=256)
        x = x.cuda()
        models = {"bare": copy.deepcopy(module).cuda(),
                  "torch": TorchDDP(copy.deepcopy(module).cuda(), device_ids=[0]),
                  "pycomm": pycomm.DistributedDataParallel(copy.deepcopy(module).cuda(),
                                                           device_ids=[0]),
                  # without the per-step timeline (its device events, Note [Timeline])
                  "pycomm_notl": pycomm.DistributedDataParallel(
                      copy.deepcopy(module).cuda(), device_ids=[0],
                      config=pycomm.DDPConfig(record_timeline=False))}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-6) for k, m in models.items()}

        def step(k, models=models, opts=opts, x=x):
            opts[k].zero_grad(set_to_none=True)
            models[k](x).float().pow(2).mean().backward()
            opts[k].step()

        for k in models:
            for _ in range(STEPS):
                step(k)
        samples = {k: [] for k in models}
        order = list(models)
        for rep in range(REPS):
            for k in order[rep % len(order):] + order[:rep % len(order)]:
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(STEPS):
                    step(k)
                torch.cuda.synchronize()
                samples[k].append((time.perf_counter() - t) / STEPS * 1e3)
        med = {k: statistics.median(v) for k, v in samples.items()}
        if ns.profile and name == "mlp":
            profile_host(step, ("bare", "pycomm"), ns.profile)
        in_place = [b["in_place"] for b in models["pycomm"].timelines(1)[0]["buckets"]]
        rows.append({"model": name, "step_ms": med,
                     "pycomm_vs_torch": med["pycomm"] / med["torch"],
                     "pycomm_vs_bare": med["pycomm"] / med["bare"],
                     "torch_vs_bare": med["torch"] / med["bare"],
                     "pycomm_notl_vs_bare": med["pycomm_notl"] / med["bare"],
                     "buckets_in_place": in_place})
    dist.destroy_process_group()
    print(f"# one-rank DDP on NCCL, {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"{REPS} interleaved blocks of {STEPS} steps, medians (ms per step)")
    print(f"{'model':>12} {'bare':>8} {'torch':>8} {'pycomm':>8} {'no tl':>8} "
          f"{'pycomm/torch':>13} {'pycomm/bare':>12} {'torch/bare':>11} {'no tl/bare':>11}"
          f"  in place")
    for r in rows:
        m = r["step_ms"]
        print(f"{r['model']:>12} {m['bare']:8.3f} {m['torch']:8.3f} {m['pycomm']:8.3f} "
              f"{m['pycomm_notl']:8.3f} {r['pycomm_vs_torch']:13.3f} "
              f"{r['pycomm_vs_bare']:12.3f} {r['torch_vs_bare']:11.3f} "
              f"{r['pycomm_notl_vs_bare']:11.3f}  {sum(r['buckets_in_place'])}/"
              f"{len(r['buckets_in_place'])}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
