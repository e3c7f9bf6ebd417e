"""`pycomm-bench collectives` on the "pycomm" backend: int64 among the dtypes, and more
CPU ranks than cores refused by default but allowed by --oversubscribe, with a warning
in the output header (the figures then measure the scheduler as well)."""

from __future__ import annotations

import os
import subprocess
import sys

from pycomm.bench.__main__ import main

_CORES = len(os.sched_getaffinity(0))


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "pycomm.bench", *argv], capture_output=True,
                          text=True, timeout=120)


def test_more_ranks_than_cores_refused_naming_the_override(capsys):
    assert main(["collectives", "--nproc", str(_CORES + 1)]) == 2
    _, err = capsys.readouterr()
    assert "--nproc" in err and "--oversubscribe" in err


def test_oversubscribed_run_warns_in_header_and_int64_is_exact():
    proc = _cli("collectives", "all_reduce", "-b", "8", "-e", "64K", "-f", "8192", "-w", "1",
                "-n", "2", "-d", "int64,float32", "-o", "sum,max", "--backend", "pycomm",
                "--nproc", str(_CORES + 1), "--oversubscribe")
    assert proc.returncode == 0, proc.stderr
    header = [line for line in proc.stdout.splitlines() if line.startswith("#")]
    assert any(line.startswith("# WARNING: oversubscribed") for line in header), proc.stdout
    assert "--oversubscribe" in proc.stdout  # in the recorded command
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert {r[2] for r in rows} == {"int64", "float"}
    assert len(rows) == 2 * 2 * 2  # dtypes x ops x sizes (8 B, 64 KiB)
    assert "# Out of bounds values : 0 OK" in proc.stdout
