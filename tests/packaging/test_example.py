"""examples/train.py runs as documented: spawning its own 2 ranks, and under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import REPO

ROOT = str(REPO)


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _losses(out: str) -> list[float]:
    return [float(line.split()[-1]) for line in out.splitlines() if line.startswith("epoch")]


def test_example_spawned_and_under_torchrun():
    spawned = _run([sys.executable, "examples/train.py", "--epochs", "2"])
    losses = _losses(spawned)
    assert len(losses) == 2 and losses[1] < losses[0], spawned
    assert "replicas identical" in spawned
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--standalone", "examples/train.py", "--epochs", "2"])
    assert _losses(out) == losses and "replicas identical" in out, out
