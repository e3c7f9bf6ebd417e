"""tools/gpu_check.py, the GPU machine's one command, where it can be checked without a
GPU: the dry run validates its plan (every pycomm-bench command line parses) and says no
device was found; a real run without a device says so and exits 2, writing nothing; the
record's markdown carries the environment, each step's outcome and the failures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support import gpu
from tests.support.paths import REPO

_TOOL = REPO / "tools" / "gpu_check.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check", _TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*argv):
    return subprocess.run([sys.executable, str(_TOOL), *argv], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.mark.skipif(gpu.missing() is None, reason="a CUDA device is here: not a dry run")
def test_without_a_device_the_dry_run_checks_the_plan_and_says_so(tmp_path):
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device found" in proc.stdout
    assert proc.stdout.count("  bench: pycomm-bench ") == len(_tool().BENCHES)
    proc = _run("--record", str(tmp_path))
    assert proc.returncode == 2 and "no CUDA device found" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_every_benchmark_command_line_parses():
    from pycomm.bench.__main__ import parse

    for _, args in _tool().BENCHES:
        assert parse(args).command == args[0]


def test_unknown_step_is_refused_naming_it():
    proc = _run("--steps", "tests,bogus")
    assert proc.returncode == 2 and "--steps: unknown ['bogus']" in proc.stderr


def test_record_markdown_names_the_device_the_steps_and_the_failures():
    tool = _tool()
    out = "2 failed, 30 passed, 1 skipped in 9.1s"
    counts = tool._pytest_counts("FAILED tests/gpu/test_x.py::test_a - boom\n" + out)
    assert counts == {"failed": 2, "passed": 30, "skipped": 1,
                      "failures": ["tests/gpu/test_x.py::test_a"]}
    record = {"command": "python3 tools/gpu_check.py",
              "environment": {"date": "2026-11-25T10:00:00+00:00", "device": "NVIDIA H100",
                              "torch": "2.11.0", "nccl": "2.27.7"},
              "steps": {"tests": {"ok": False, "seconds": 9.1,
                                  "runs": [{"command": "-m pytest tests/gpu", "rc": 1,
                                            **counts}]},
                        "bench": {"ok": True, "seconds": 3.0,
                                  "runs": [{"command": "pycomm-bench clip", "rc": 0,
                                            "seconds": 3.0, "table": "# a table"}]}}}
    md = tool.markdown(record)
    assert md.startswith("# GPU check, 2026-11-25: NVIDIA H100")
    assert "| nccl | 2.27.7 |" in md and "## tests: FAILED (9.1 s)" in md
    assert "  - tests/gpu/test_x.py::test_a" in md and "# a table" in md
