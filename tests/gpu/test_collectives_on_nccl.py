"""`pycomm-bench collectives` on NCCL, as a user runs it on one GPU: every collective a
one-GPU group can run (send/recv needs two ranks), every reduction on the float types and
the integer ones, each result checked on exact data (nccl-tests' "Out of bounds values"),
the table and the JSON written. No timing is asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import gpu

gpu.require()

from pycomm.bench.report import Report  # noqa: E402

ONE_GPU = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
           "barrier"]


@pytest.mark.parametrize("dtypes, ops", [("float32,bfloat16,float16,float64", "all"),
                                         ("int32,int64", "sum,max,min")])
def test_collectives_sweep_on_nccl_checks_every_result(tmp_path, dtypes, ops):
    path = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pycomm.bench", "collectives", *ONE_GPU, "--nproc", "1",
         "--backend", "nccl", "-b", "8", "-e", "4M", "-f", "8", "-w", "2", "-n", "5",
         "-o", ops, "-d", dtypes, "--json", str(path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = Report.from_json(path.read_text())
    assert report.meta.backend == "nccl" and report.meta.world == 1
    assert "cpu" not in report.meta.device.lower(), report.meta.device
    assert report.wrong == 0 and "# Out of bounds values : 0 OK" in proc.stdout
    assert {r.collective for r in report.rows} == set(ONE_GPU)
    assert {r.type for r in report.rows if r.size} == {
        {"float32": "float", "bfloat16": "bfloat16", "float16": "half", "float64": "double",
         "int32": "int32", "int64": "int64"}[d] for d in dtypes.split(",")}
    assert all(m.busbw >= 0 and m.p50_us > 0 for r in report.rows for m in r.measures)
