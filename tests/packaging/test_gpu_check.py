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


def test_a_build_whose_errors_crash_is_rebuilt_with_the_next_compiler(tmp_path, monkeypatch):
    """Note [The compiler that builds the GPU check]: the first compiler's extension dies
    in the smoke check (a signal), so the build dir goes and the next compiler builds; an
    ordinary failure stops there."""
    tool = _tool()
    calls = []

    def fake_run(argv, log, env, timeout):
        smoke = argv[1] == "-c"
        cxx = calls[-1][0] if smoke else env.get("CXX")  # the smoke check runs what was built
        calls.append((cxx, "smoke" if smoke else "build"))
        return (-11 if smoke and cxx == "/opt/gcc/bin/g++" else 0), 1.0, ""

    (tmp_path / "build").mkdir()
    monkeypatch.setattr(tool, "_run", fake_run)
    monkeypatch.setattr(tool, "BUILD", tmp_path / "build")
    monkeypatch.setattr(tool, "compilers", lambda env: ["/opt/gcc/bin/g++", "/usr/bin/g++"])
    env = {"cpus": 2, "capability": "9.0"}
    step = tool.step_build(env, tmp_path, {})
    assert step["ok"] and step["cxx"] == "/usr/bin/g++"
    assert calls == [("/opt/gcc/bin/g++", "build"), ("/opt/gcc/bin/g++", "smoke"),
                     ("/usr/bin/g++", "build"), ("/usr/bin/g++", "smoke")]
    assert not (tmp_path / "build").exists()
    assert "- CXX `/opt/gcc/bin/g++`: build exit 0, smoke check exit -11" in tool.markdown(
        {"command": "c", "environment": {"date": "2026-11-26"}, "steps": {"build": step}})
    calls.clear()
    monkeypatch.setattr(tool, "_run", lambda argv, log, env, timeout: (1, 1.0, ""))
    step = tool.step_build(env, tmp_path, {})
    assert not step["ok"] and len(step["attempts"]) == 1


def test_a_crashed_test_is_named_and_the_run_goes_on_without_it(tmp_path, monkeypatch):
    tool = _tool()
    crash = ('...Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call '
             'first):\n  File "/x/pycomm/clip.py", line 59 in clip_grad_norm_\n'
             '  File "/x/tests/gpu/test_k.py", line 135 in test_raises\n'
             '  File "/x/_pytest/python.py", line 167 in pytest_pyfunc_call\n')
    assert tool.crashed_test(crash) == "test_raises"
    assert tool.crashed_test("1 passed in 1s") is None
    seen = []

    def fake_run(argv, log, env, timeout):
        seen.append(argv)
        if "-k" in argv and "test_raises" in argv[argv.index("-k") + 1]:
            return 1, 1.0, "FAILED tests/gpu/test_k.py::test_b - x\n1 failed, 9 passed in 2s"
        return -11, 1.0, crash

    monkeypatch.setattr(tool, "_run", fake_run)
    monkeypatch.setattr(tool, "TESTS", [["{py}", "-m", "pytest", "-k", "cuda", "tests/gpu"]])
    step = tool.step_tests({}, tmp_path, {})
    assert len(seen) == 2 and seen[1][seen[1].index("-k") + 1] == "(cuda) and not test_raises"
    run = step["runs"][0]
    assert not step["ok"] and run["passed"] == 9
    assert run["failures"] == ["tests/gpu/test_k.py::test_b", "test_raises (crashed the process)"]
