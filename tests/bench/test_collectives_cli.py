"""The `pycomm-bench collectives` command: bad input is a one-line error naming the flag
with exit code 2 and nothing on stdout (in process: checked before any rank starts); a
real run writes the table, JSON, CSV and plot; a wrong result makes it exit 1."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from pycomm.bench import collectives
from pycomm.bench.__main__ import main
from pycomm.bench.collectives_run import CORRUPT_ENV
from pycomm.bench.report import Report

_CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("argv, flag", [
    (["-b", "12Q"], "-b/--min-bytes"),
    (["-e", "1T"], "-e/--max-bytes"),
    (["-b", "1M", "-e", "4K"], "-e/--max-bytes"),
    (["-b", "0"], "-b/--min-bytes"),
    (["-f", "1"], "-f/--step-factor"),
    (["-f", "2", "-i", "8"], "-i/--step-bytes"),
    (["-n", "0"], "-n/--iters"),
    (["-w", "x"], "-w/--warmup"),
    (["-c", "2"], "-c/--check"),
    (["-o", "prod"], "-o/--op"),
    (["-d", "float8"], "-d/--dtype"),
    (["-o", "avg", "-d", "int32"], "-o/--op"),
    (["all_reduce", "all_gatherr"], "collective"),
    (["-r", "2"], "-r/--root"),
    (["--nproc", str(_CORES + 1)], "--nproc"),
    (["--nproc", "0"], "--nproc"),
    (["sendrecv", "--nproc", "1"], "--nproc"),
    (["--backend", "nosuch"], "--backend"),
    (["-e", "1G", "-i", "1"], "-i/--step-bytes"),
    (["--json", "/nonexistent/dir/r.json"], "--json"),
    (["--csv", "/nonexistent/dir/r.csv"], "--csv"),
    (["--bogus"], "--bogus"),
])
def test_bad_input_is_one_line_naming_the_flag(argv, flag, capsys):
    try:
        rc = main(["collectives", *argv])
    except SystemExit as e:  # argparse's own checks exit from the parser
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and "error" in err


def test_memory_beyond_the_machine_names_max_bytes(capsys):
    assert main(["collectives", "-e", f"{1 << 40}"]) == 2
    assert "-e/--max-bytes" in capsys.readouterr().err


def test_torchrun_world_without_backend(monkeypatch, capsys):
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    assert main(["collectives"]) == 2
    assert "--backend" in capsys.readouterr().err
    monkeypatch.delenv("MASTER_PORT")
    assert main(["collectives", "--backend", "gloo"]) == 2
    assert "MASTER_PORT" in capsys.readouterr().err


def test_plot_without_matplotlib(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["collectives", "--plot", str(tmp_path / "p.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_probe_refuses_what_the_backend_refuses(monkeypatch):
    # Every op/dtype pair pycomm-bench offers works on torch 2.13's Gloo, so stand in a
    # reduction Gloo refuses on floats (bitwise and) for "max": the probe must turn the
    # backend's own refusal into a usage error naming -o.
    monkeypatch.setitem(collectives.REDUCE_OPS, "max", dist.ReduceOp.BAND)
    with pytest.raises(collectives.UsageError, match="-o/--op: max on float32 .* gloo"):
        collectives._probe_reductions("gloo", ("sum", "max"), ("float32",))
    assert not dist.is_initialized()


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "pycomm.bench", *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_run_writes_table_json_csv_plot(tmp_path):
    paths = {k: tmp_path / f"r.{k}" for k in ("json", "csv", "png")}
    plot = ["--plot", str(paths["png"])] if importlib.util.find_spec("matplotlib") else []
    proc = _cli("collectives", "all_reduce", "all_gather", "barrier", "-b", "4", "-e", "4K",
                "-f", "32", "-w", "1", "-n", "3", "--json", str(paths["json"]), "--csv",
                str(paths["csv"]), *plot)
    assert proc.returncode == 0, proc.stderr
    report = Report.from_json(paths["json"].read_text())
    assert [r.size for r in report.rows] == [4, 128, 4096, 128, 4096, 0]  # 4 B: no all-gather chunk
    assert report.meta.world == 2 and report.meta.backend == "gloo" and report.wrong == 0
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert f"# Avg bus bandwidth    : {report.avg_busbw:.4f}" in proc.stdout
    assert len(paths["csv"].read_text().splitlines()) == 1 + 3 + 2 * 2 + 1
    if plot:
        assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    json.loads(paths["json"].read_text())


def test_wrong_result_fails_the_command():
    proc = _cli("-b", "64", "-e", "64", "-w", "0", "-n", "1",
                env={CORRUPT_ENV: "1"})
    assert proc.returncode == 1, proc.stderr
    assert "# Out of bounds values : 1 FAILED" in proc.stdout


def test_under_torchrun_joins_its_world(tmp_path):
    # --standalone: torchrun picks a free port and a local rendezvous, nothing fixed.
    path = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pycomm.bench", "collectives", "--backend", "gloo", "-b", "64", "-e", "64",
         "-w", "0", "-n", "2", "--json", str(path)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = Report.from_json(path.read_text())
    assert report.meta.world == 2 and report.wrong == 0 and len(report.rows) == 1
    assert proc.stdout.count("# Out of bounds values") == 1  # rank 0 prints alone
