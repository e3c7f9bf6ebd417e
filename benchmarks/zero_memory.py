"""Peak memory of one rank training with AdamW, each implementation in processes of its
own (so each peak is its own): pycomm's DDP, pycomm's ZeroRedundancyOptimizer on it
(gradients kept, or released), torch's DDP with torch's ZeroRedundancyOptimizer, FSDP2.
The bench model (the 25.2M
parameter MLP of pycomm-bench ddp), 2 local Gloo ranks, 1 thread each, a few steps.

Reported per implementation (the larger rank):
  peak_MB       peak resident memory over steps 3-5 (the kernel's high-water mark, reset
                after two warm-up steps: pycomm's sharded optimizer keeps whole buckets in
                its first step, until the DDP's one bucket re-cut) minus the resident
                memory after the model was built, before the implementation wrapped it
  first_MB      the same over the warm-up steps (construction and the first steps)
  grads_MB      gradient bytes held right after a synchronized backward: param.grad, the
                DDP's buckets (their storage), and the sharded optimizer's kept shards
  state_MB      optimizer state bytes
glibc is told to return freed blocks (M_TRIM_THRESHOLD, M_MMAP_THRESHOLD at 1 MiB) so
that the peak follows what is live rather than what the heap kept.

    python benchmarks/zero_memory.py --json benchmarks/results/zero_memory_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import resource
import sys

import torch
import torch.distributed as dist

from pycomm.bench import common, ddp, sharded
from pycomm.bench.models import build_model

IMPLS = ("pycomm", "pycomm_zero", "pycomm_zero_released", "torch_zero", "fsdp2")


def _return_freed_memory() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # kB there means KiB
    return float("nan")


def _grad_bytes(model, opt) -> int:
    seen, total = set(), 0

    def count(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for p in model.parameters():
        if p.grad is not None:
            count(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    reducer = getattr(model, "reducer", None)
    if isinstance(model, ddp.PycommDDP):
        for i in range(len(model._named_params)):
            count(reducer.grad_view(i))
    if isinstance(opt, sharded.ZeroRedundancyOptimizer):
        for t in opt._hook_state.grads.values():
            count(t)
    return total


def _rank(impl: str) -> dict:
    _return_freed_memory()
    module, x = build_model("mlp", 32)
    before = _resident_mb()
    _reset_peak()
    model = ddp.IMPLS[impl](module, bucket_cap_mb=25.0)
    opt = sharded.optimizer(impl, model, "adamw")
    grads = 0
    for step in range(5):
        if step == 2:
            first = _peak_mb()
            _reset_peak()
        opt.zero_grad()
        model(x).square().mean().backward()
        grads = _grad_bytes(model, opt)
        opt.step()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    t = torch.tensor([_peak_mb() - before, first - before, grads / 1e6,
                      sharded.state_bytes(opt) / 1e6], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(("peak_mb", "first_mb", "grads_mb", "state_mb"), t.tolist()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    rows = {}
    for impl in ns.impls.split(","):
        rows[impl] = common.launch(_rank, impl, 2, "gloo", timeout_s=600.0)
        print(f"{impl:>12}  peak {rows[impl]['peak_mb']:8.1f} MB  first steps "
              f"{rows[impl]['first_mb']:8.1f} MB  grads "
              f"{rows[impl]['grads_mb']:7.1f} MB  state {rows[impl]['state_mb']:7.1f} MB",
              flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
