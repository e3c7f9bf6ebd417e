"""The fused clip's kernels one by one, for Nsight Compute: the two GPU cases whose
targets the wall clock and CUDA events have not explained (1,000 gradients of 1,024
float32 elements; GPT-2 small's bfloat16 gradients, clip inactive), eager and replayed in
a CUDA graph. Run it under ncu, which times and counts each kernel:

    ncu --clock-control none --kernel-name regex:tile_ \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active \
        python benchmarks/gpu_clip_kernels.py

Each case runs `--reps` clips after two warm-up ones (the plan is made in the first), with
an NVTX range naming the case around them; an active clip has max_norm 0, so that every
rep scales.
"""

from __future__ import annotations

import argparse
import sys

import torch

from pycomm import clip as pycomm_clip
from pycomm.bench.clip import CASES, _grads, _graph_replay, _holder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    ns = p.parse_args(argv)
    device = torch.device("cuda", 0)
    cases = [("1000x1024", torch.float32, 0.5), ("1000x1024", torch.float32, 2.0),
             ("gpt2-small", torch.bfloat16, 2.0), ("gpt2-small", torch.float32, 2.0)]
    for case, dtype, rel in cases:
        grads = _grads(CASES[case](), dtype, device, seed=0)
        holders = [_holder(g) for g in grads]
        norm = torch.nn.utils.clip_grad_norm_(holders, float("inf"), foreach=True).item()
        # active: max_norm 0 scales at every rep (by 0: the same traffic); inactive: above
        max_norm = 0.0 if rel < 1 else rel * norm
        label = f"{case} {dtype} {'active' if rel < 1 else 'inactive'}"
        for _ in range(2):
            pycomm_clip.clip_grad_norm_(holders, max_norm)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"eager {label}")
        for _ in range(ns.reps):
            pycomm_clip.clip_grad_norm_(holders, max_norm)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        replay = _graph_replay(grads, rel)
        torch.cuda.nvtx.range_push(f"graph {label}")
        for _ in range(ns.reps):
            replay(None, None)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"{label}: {len(grads)} tensors, {sum(g.numel() for g in grads)} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
