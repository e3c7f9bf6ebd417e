"""What deciding whether the one-pass Adam applies costs a step, before and after it was
remembered (Note [Deciding once, checking each step] in pycomm/adam_step.py): an AdamW over
many small parameters, where the decision is the largest part of the step.

  walk     step_reason(): the options, then every parameter, gradient and state in
           Python; what each step() did before
  decide   decide(): the options and hooks each step, the walk remembered
  step_*   a whole step of the kernel, after the walk (the old step()) or try_step()

Each timed block is `--calls` calls of one kind, the kinds interleaved (the order reversed
every block); the per-call time is the median over `--blocks` blocks. The last kinds step
the parameters, so they run on their own copy.

    PYTHONPATH=. python benchmarks/adam_step_decision.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pycomm
from pycomm import adam_step

KINDS = ("walk", "decide", "step_walk", "step_remembered")


def _optimizer(params: int, numel: int, groups: int) -> pycomm.optim.AdamW:
    generator = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(numel, generator=generator)) for _ in range(params)]
    for p in ps:
        p.grad = torch.randn(numel, generator=generator)
    per = -(-params // groups)
    opt = pycomm.optim.AdamW([{"params": ps[i:i + per]} for i in range(0, params, per)],
                             lr=1e-3, weight_decay=0.01)
    opt.step()  # the states made, the form probed, the walk remembered
    assert opt.step_kernel == pycomm.optim.ONE_PASS_STEP, opt.step_kernel
    return opt


def _call(kind: str, opts: dict[str, pycomm.optim.AdamW]):
    opt = opts[kind]
    cls = opt.one_pass_of
    if kind == "walk":
        return lambda: adam_step.step_reason(opt, cls)
    if kind == "decide":
        return lambda: adam_step.decide(opt, cls)
    if kind == "step_walk":
        return lambda: adam_step.step_reason(opt, cls) or adam_step.step(opt)
    return lambda: adam_step.try_step(opt, cls)


def run(params: int, numel: int, groups: int, calls: int, blocks: int) -> dict[str, float]:
    opts = {kind: _optimizer(params, numel, groups) for kind in KINDS}
    fns = {kind: _call(kind, opts) for kind in KINDS}
    for fn in fns.values():  # warm-up, untimed; each must leave the kernel on
        assert fn() is None
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for block in range(blocks):
        for kind in KINDS if block % 2 == 0 else KINDS[::-1]:
            fn = fns[kind]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[kind].append((time.perf_counter() - start) / calls)
    return {kind: statistics.median(s) * 1e6 for kind, s in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=2000, help="parameters in the optimizer")
    p.add_argument("--numel", type=int, default=64, help="elements per parameter")
    p.add_argument("--groups", type=int, default=2, help="param groups")
    p.add_argument("--calls", type=int, default=20, help="calls per timed block")
    p.add_argument("--blocks", type=int, default=31, help="timed blocks per kind")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    us = run(ns.params, ns.numel, ns.groups, ns.calls, ns.blocks)
    print(f"# pycomm {pycomm.__version__} | torch {torch.__version__} | cpu "
          f"{torch.backends.cpu.get_cpu_capability()} | threads {ns.threads} | params "
          f"{ns.params} x {ns.numel} float32 in {ns.groups} groups | {ns.blocks} blocks of "
          f"{ns.calls} calls, interleaved, median")
    print(f"#{'kind':>16} {'time':>10}")
    print(f"#{'':>16} {'(us)':>10}")
    for kind, t in us.items():
        print(f"{kind:>17} {t:>10.1f}")
    print(f"# decision: {us['walk'] / us['decide']:.0f}x less; step: "
          f"{us['step_walk'] / us['step_remembered']:.2f}x less")


if __name__ == "__main__":
    main()
