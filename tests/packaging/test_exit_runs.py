"""tools/exit_runs.py, a few runs of each path: a short DDP job under torchrun whose every
rank exits with its own status, never SIGABRT, with or without destroy_process_group(),
over shared memory and over the Gloo fallback (Note [No Python object in a collective's
thread state] in csrc/comm/thread_state.h). The full count (50 runs and more of each) is
the tool's to run; this keeps the paths working and catches a return of the abort when it
is frequent."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.paths import REPO


def test_every_rank_exits_cleanly_on_each_path(tmp_path):
    record = tmp_path / "exits.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "exit_runs.py"), "--runs", "1",
                           "--json", str(record)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    runs = json.loads(record.read_text())
    assert {(r["path"], r["ending"]) for r in runs} >= {("shm", "destroy"), ("shm", "no-destroy")}
    assert all(r["rc"] == 0 and not r["aborted"] and r["trained"] for r in runs), runs


def test_bad_arguments_are_named():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "exit_runs.py"), "--paths",
                           "hosts"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "unknown path 'hosts'" in proc.stderr, proc.stderr
