"""Would the within-host phases of the hierarchical all-reduce gain from a low-precision
wire (issue 40)? Only the cross-host leg carries DDPConfig.wire; the phases inside a host
stay float32 on pycomm's shared-memory backend. This times, on a pycomm group of local ranks,
what one such phase costs for a bucket in float32 against what it would cost in bfloat16:
the conversion to bf16, the bf16 all-reduce (float32 accumulation) and the conversion back,
and the bf16 all-reduce alone (the bytes halved, no conversion: the bound of the idea).
Blocks interleaved, medians over blocks, the load recorded.

    python benchmarks/wire_within_host.py --sizes 2M,25M --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = ("fp32", "bf16_with_conversions", "bf16_alone")


def _rank(rank: int, world: int, port: int, numel: int, blocks: int, calls: int, out: str):
    import pycomm  # noqa: F401  (registers the backend)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("pycomm", rank=rank, world_size=world)
    torch.set_num_threads(1)
    x = torch.randn(numel) * 1e-3
    low = x.to(torch.bfloat16)

    def fp32():
        dist.all_reduce(x)

    def bf16_with_conversions():
        y = x.to(torch.bfloat16)
        dist.all_reduce(y)
        x.copy_(y)

    def bf16_alone():
        dist.all_reduce(low)

    fns = dict(zip(CASES, (fp32, bf16_with_conversions, bf16_alone)))
    times = {name: [] for name in CASES}
    for f in fns.values():
        f()
    for _ in range(blocks):
        for name, f in fns.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times[name].append((time.perf_counter() - t) / calls)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({name: statistics.median(v) for name, v in times.items()}, fh)
    dist.destroy_process_group()


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2M,25M", help="float32 bucket bytes, comma-separated")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--blocks", type=int, default=9)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    load_before = os.getloadavg()
    for i, text in enumerate(args.sizes.split(",")):
        nbytes = _size(text)
        out = f"/tmp/wire_within_host_{os.getpid()}_{i}.json"
        mp.spawn(_rank, args=(args.nproc, 29650 + i, nbytes // 4, args.blocks, args.calls, out),
                 nprocs=args.nproc)
        with open(out) as fh:
            med = json.load(fh)
        os.unlink(out)
        row = {"bytes": nbytes, **{f"{k}_ms": v * 1e3 for k, v in med.items()},
               **{f"{k}_vs_fp32": v / med["fp32"] for k, v in med.items() if k != "fp32"}}
        rows.append(row)
        print(json.dumps(row))
    result = {"nproc": args.nproc, "torch": torch.__version__, "rows": rows,
              "load_before": load_before, "load_after": os.getloadavg(),
              "command": " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
