"""Elastic restarts under torchrun: a rank killed mid-run, torchrun starts a new generation,
pycomm's DDP is built again on the new process group, nothing of the killed generation
stays in /dev/shm, and training resumes from the checkpoint to the very parameters of an
uninterrupted run with torch's DDP (tests/support/elastic_worker.py)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import torch

from tests.support.paths import REPO

ROOT = str(REPO)
WORKER = os.path.join(ROOT, "tests", "support", "elastic_worker.py")
STEPS = 8


def _torchrun(out: str, *args: str, max_restarts: int = 0) -> subprocess.CompletedProcess:
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
           "--monitor-interval", "0.1", WORKER, out, "--steps", str(STEPS), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/pycomm-*"))


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_killed_rank_restarts_and_resumes(tmp_path):
    before = _shm_segments()
    reference = _torchrun(str(tmp_path / "reference"), "--impl", "torch")
    assert reference.returncode == 0, reference.stdout + reference.stderr

    run = _torchrun(str(tmp_path / "elastic"), "--impl", "pycomm", "--kill-rank", "1",
                    "--kill-step", "3", max_restarts=1)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log

    out = tmp_path / "elastic"
    gen0 = [_read(out / f"gen0_rank{r}.json") for r in range(2)]
    gen1 = [_read(out / f"gen1_rank{r}.json") for r in range(2)]
    assert not (out / "gen2_rank0.json").exists(), "more than one restart:\n" + log
    # A new generation of processes, each building pycomm's DDP over its own new group.
    assert {g["pid"] for g in gen0}.isdisjoint(g["pid"] for g in gen1)
    assert all(g["world"] == 2 and g["grad_backend"] == "pycomm" for g in gen0 + gen1)
    assert [g["start"] for g in gen0] == [0, 0]
    # Resumed from a checkpoint, not from the start: normally the one rank 0 saved after
    # step 3 (the step rank 1 died after; rank 0 cannot finish step 4 without it), or the
    # one before if torchrun stopped rank 0 before it had saved.
    starts = {g["start"] for g in gen1}
    assert len(starts) == 1 and starts <= {3, 4}, gen1

    # The killed generation's shared-memory segment was unlinked once mapped: a SIGKILL
    # leaves nothing behind.
    leftover = {s for s in _shm_segments() - before
                if any(f"-{g['pid']}-" in s for g in gen0 + gen1)}
    assert not leftover, leftover

    ref = torch.load(tmp_path / "reference" / "final_rank0.pt")
    for r in range(2):
        final = torch.load(out / f"final_rank{r}.pt")
        assert final.keys() == ref.keys()
        for name, value in ref.items():
            # Same inputs, same sums of two float32 gradients, same optimizer arithmetic:
            # bitwise equal to the uninterrupted run.
            assert torch.equal(final[name], value), (r, name)
