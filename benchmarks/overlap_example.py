"""The examples of docs/overlap.md ("Is my communication overlapped?"), on real steps: a report of
the benchmark MLP's last step (2 local Gloo ranks) and a what-if table replaying it.

    python benchmarks/overlap_example.py [--trace PATH]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pycomm
from pycomm.bench import common
from pycomm.overlap import AlphaBeta, format_what_if, param_nbytes_from, what_if


def _body(trace: str | None) -> tuple[str, str]:
    torch.manual_seed(0)  # pycomm-bench ddp's "mlp": 6 x (2048 x 2048), batch 32
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.ReLU())])
    x = torch.randn(32, 2048)
    ddp = pycomm.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    for _ in range(5):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    if trace:
        ddp.export_chrome_trace(trace, all_ranks=True)
    step = ddp.last_step_report()
    sizes = param_nbytes_from(step, [p.numel() for p in model.parameters()])
    nets = {"100 Gb/s": AlphaBeta.from_link(100, 5, "tree"),
            "400 Gb/s": AlphaBeta.from_link(400, 5, "tree")}
    table = format_what_if(what_if(step, nets, [8, 64, 1024], [None, 4 << 20, 100 << 20],
                                   param_nbytes=sizes, first_cap_bytes=1 << 20))
    return str(step), table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="also write the 2 ranks' Chrome trace")
    report, table = common.launch(_body, ap.parse_args().trace, 2, "gloo")
    print(report)
    print()
    print(table)


if __name__ == "__main__":
    main()
