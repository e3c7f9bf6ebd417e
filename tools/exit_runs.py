"""How a pycomm DDP job's processes exit, counted over many runs.

Each run starts a short DDP job under torchrun (2 local ranks, 3 steps, the bench's small
model) and records every rank's exit: its status, and whether it aborted (SIGABRT, or
"terminate called" on its stderr). A job ends either with destroy_process_group() or
without it; its gradients go through pycomm's shared memory ("shm"), or over Gloo because
the segment does not fit /dev/shm ("gloo-fallback": the ranks run in a mount namespace
whose /dev/shm is 64 KiB; root and unshare(1) only). Note [No Python object in a
collective's thread state] in csrc/comm/thread_state.h has what made the Gloo path abort.

    python tools/exit_runs.py --runs 50                  # every path, 50 runs each
    python tools/exit_runs.py --paths gloo-fallback --runs 100 --json exits.json

Prints one line per path (runs, clean exits, aborts, other failures) and exits 1 when any
run did not exit cleanly, with that run's stderr tail."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

JOB = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import pycomm

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = pycomm.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ddp(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
    print("trained", flush=True)
    if sys.argv[1] == "destroy":
        dist.destroy_process_group()
""")

PATHS = ("shm", "gloo-fallback")
ENDINGS = ("destroy", "no-destroy")


def unavailable(path: str) -> str | None:
    """Why `path` cannot run on this machine, or None."""
    if path == "gloo-fallback" and (os.geteuid() != 0 or shutil.which("unshare") is None):
        return "needs root and unshare(1) for a mount namespace with a small /dev/shm"
    return None


def run_once(path: str, ending: str, script: Path, timeout: float = 120.0) -> dict:
    """One job: its exit status, whether it aborted, and the tail of its output."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(script), ending]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if path == "gloo-fallback":
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                "mount -t tmpfs -o size=64k tmpfs /dev/shm && exec \"$@\"", "sh", *torchrun]
    else:
        argv = torchrun
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
    out = proc.stdout + proc.stderr
    aborted = ("terminate called" in out or "Signal 6" in out or "SIGABRT" in out
               or proc.returncode in (-6, 134))
    trained = out.count("trained") >= 2
    return {"path": path, "ending": ending, "rc": proc.returncode, "aborted": aborted,
            "trained": trained, "seconds": round(time.monotonic() - start, 2),
            "tail": "" if proc.returncode == 0 and not aborted else out[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per path and ending")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--endings", default=",".join(ENDINGS),
                        help=f"comma-separated, of {', '.join(ENDINGS)}")
    parser.add_argument("--json", help="write every run's record here")
    ns = parser.parse_args(argv)
    paths = [p for p in ns.paths.split(",") if p]
    endings = [e for e in ns.endings.split(",") if e]
    for name, given, known in (("path", paths, PATHS), ("ending", endings, ENDINGS)):
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown[0]!r}: expected one of {', '.join(known)}")
    if ns.runs < 1:
        parser.error(f"--runs must be at least 1, got {ns.runs}")
    records, bad = [], []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "three_steps.py"
        script.write_text(JOB)
        for path in paths:
            why = unavailable(path)
            if why:
                print(f"{path}: skipped ({why})")
                continue
            for ending in endings:
                runs = [run_once(path, ending, script) for _ in range(ns.runs)]
                records += runs
                clean = sum(r["rc"] == 0 and not r["aborted"] and r["trained"] for r in runs)
                aborted = sum(r["aborted"] for r in runs)
                print(f"{path:14s} {ending:10s} runs {len(runs)}  clean {clean}  "
                      f"aborted {aborted}  other {len(runs) - clean - aborted}", flush=True)
                bad += [r for r in runs if r["tail"] or not r["trained"]]
    if ns.json:
        Path(ns.json).write_text(json.dumps(records, indent=1))
    for r in bad[:3]:
        print(f"--- {r['path']} {r['ending']} rc {r['rc']}:\n{r['tail']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
