"""The GPU machine in one command: build pycomm's CUDA extension against the torch there,
run the GPU tests, run the GPU benchmarks, and write one record of it all.

    python tools/gpu_check.py                 # everything, record under benchmarks/results/
    python tools/gpu_check.py --steps tests   # one step (build, tests, bench), comma list
    python tools/gpu_check.py --dry-run       # the plan and every check short of a device

Steps, each timed, logged and recorded even when an earlier one failed (one run on a
lent machine should bring back as much as it can):
  build  PYCOMM_CUDA=1 python setup.py build_ext --inplace, for this GPU's architecture;
         then pycomm._C.cuda must be True.
  tests  tests/gpu/ (pycomm's DDP on CUDA against torch's, the fused kernels against torch's
         foreach, pycomm-bench collectives on NCCL), the CUDA cases of tests/grad/ and the
         docs' GPU examples (docs/gpu.md), with
         PYCOMM_REQUIRE_CUDA=1 so that a GPU test that would skip fails instead.
  bench  pycomm-bench clip (against torch's foreach, and as a share of the copy bandwidth;
         eager and replayed in a CUDA graph), pycomm-bench ddp on a one-GPU NCCL group
         (torch's DDP and pycomm's side by side; with SGD, and with torch's fused AdamW,
         sharded too), pycomm-bench collectives on NCCL (the size sweep),
         benchmarks/gpu_one_rank.py (the one-rank step against the bare module) and
         benchmarks/gpu_overlap.py (two Gloo ranks sharing the GPU: the per-bucket report
         and a torch.profiler trace of the streams, archived in traces.tar.gz).
The record: benchmarks/results/gpu_check_<date>_<gpu>.md and .json (device, driver, CUDA,
torch, NCCL, Python, commit, date, the command; each step's outcome; the benchmarks'
tables), with each step's log beside it in a folder that is not committed; both are written
after every step, so a run cut off keeps what it measured. Where $OUT is set (the device
machine's return folder) the record, the logs and the traces are copied there too.

Exit status: 0 when every step passed; 1 when one failed; 2 when no CUDA device was found
(with --dry-run: 0 once the plan checked out, saying that no device was found).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BUILD = REPO / "build"  # setup.py's intermediate files, removed before another compiler
STEPS = ("build", "tests", "bench")

# What each step runs; {py} is this interpreter, {cores} this machine's cores.
TESTS = [["{py}", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"],
         ["{py}", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "cuda",
          "tests/grad/test_clip.py", "tests/grad/test_ops.py"],
         # the docs' GPU examples (docs/gpu.md, marked <!-- run: gpu ranks=N -->)
         ["{py}", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "gpu.md",
          "tests/packaging/test_docs.py"]]
# (name, pycomm-bench arguments): the JSON each writes goes to <logs>/<name>.json
BENCHES = [
    ("clip_float32", ["clip", "--device", "cuda", "--dtype", "float32"]),
    ("clip_bfloat16", ["clip", "--device", "cuda", "--dtype", "bfloat16"]),
    ("ddp_nccl_1gpu", ["ddp", "--nproc", "1", "--backend", "nccl", "--models",
                       "mlp,transformer", "--impls", "torch,pycomm", "--samples", "256",
                       "--threads", "4"]),
    # the sharded step with torch's fused AdamW on its flat pieces, against torch's DDP and
    # pycomm's with the same fused AdamW
    ("ddp_adamw_fused_nccl_1gpu", ["ddp", "--nproc", "1", "--backend", "nccl", "--optimizer",
                                   "adamw_fused", "--impls", "torch,pycomm,pycomm_zero",
                                   "--models", "mlp,transformer", "--samples", "256",
                                   "--threads", "4"]),
    # the same on two Gloo ranks sharing the GPU: the sharded step at world 2
    ("ddp_adamw_fused_gloo_2ranks_1gpu", ["ddp", "--nproc", "2", "--backend", "gloo",
                                          "--device", "cuda", "--optimizer", "adamw_fused",
                                          "--impls", "torch,pycomm,pycomm_zero", "--models",
                                          "mlp", "--samples", "256", "--threads", "4"]),
    ("collectives_nccl", ["collectives", "all_reduce", "all_gather", "reduce_scatter",
                          "broadcast", "--nproc", "1", "--backend", "nccl", "-b", "8",
                          "-e", "1G", "-f", "4", "-d", "float32,bfloat16"]),
]
# (name, script under benchmarks/ and its arguments; {logs} is the step's log folder)
SCRIPTS = [
    ("one_rank", ["gpu_one_rank.py", "--json", "{logs}/one_rank.json", "--profile",
                  "{logs}/one_rank_profile.txt"]),  # bare vs DDPs
    ("overlap", ["gpu_overlap.py", "--out", "{logs}"]),  # the streams' trace, per bucket
]
TIMEOUT_S = {"build": 900, "tests": 900, "bench": 300}  # per command


def _run(argv: list[str], log: Path, env: dict, timeout: float) -> tuple[int, float, str]:
    """Run argv from the repository root, output appended to `log`; (rc, seconds, tail)."""
    start = time.monotonic()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        try:
            proc = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)
            rc, out = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            rc = 124
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += f"\n[gpu_check: killed after {timeout:.0f} s]\n"
        f.write(out + f"[exit {rc}]\n\n")
    return rc, time.monotonic() - start, out


def _capture(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict:
    """What the record says about the machine; `device` is None without a CUDA device."""
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "commit": os.environ.get("PYCOMM_COMMIT") or _capture(
               ["git", "-C", str(REPO), "rev-parse", "HEAD"]) or "unknown",
           "nvcc": (re.findall(r"release [\d.]+, V[\d.]+", _capture(["nvcc", "--version"]))
                    or [""])[0],
           "driver": _capture(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"]).splitlines()[:1],
           "cpus": os.cpu_count(), "device": None, "devices": 0}
    if torch.version.cuda is None:
        env["no_device"] = f"torch {torch.__version__} is a CPU-only build"
    elif not torch.cuda.is_available():
        env["no_device"] = (f"torch.cuda.is_available() is False (torch {torch.__version__}, "
                            f"CUDA {torch.version.cuda}; nvidia-smi: "
                            f"{_capture(['nvidia-smi', '-L']) or 'not found'})")
    else:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, devices=torch.cuda.device_count(),
                   capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count,
                   nccl=".".join(map(str, torch.cuda.nccl.version())),
                   cudnn=torch.backends.cudnn.version())
    return env


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# The build's smoke check: the CUDA kernels are in, and a C++ error whose message formats a
# number reaches Python as an exception. Built by the GPU image's own CXX (/opt/gcc, whose
# libstdc++ is partly linked statically), pycomm._C carried its own copy of the stream
# inserter for doubles, which then read the locale of the system libstdc++ the process
# loads: every such error killed the process (SIGSEGV in read_utf8_code_point, seen on
# 2026-11-26; Note [The compiler that builds the GPU check]).
SMOKE = """import torch, pycomm
print('pycomm._C.cuda', pycomm._C.cuda)
assert pycomm._C.cuda, 'pycomm._C was built without its CUDA kernels'
p = torch.nn.Parameter(torch.zeros(2))
p.grad = torch.tensor([1.0, float('inf')])
try:
    pycomm.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
except RuntimeError as e:
    assert 'non-finite' in str(e), e
else:
    raise SystemExit('error_if_nonfinite raised nothing')
print('smoke check passed')
"""


def compilers(run_env: dict) -> list[str]:
    """The C++ compilers to build with, in order: the environment's CXX, then the c++ and
    g++ on PATH (distinct files only)."""
    found, seen = [], set()
    for name in (run_env.get("CXX"), "c++", "g++"):
        path = shutil.which(name) if name else None
        if path and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            found.append(path)
    return found


def step_build(env: dict, logs: Path, run_env: dict) -> dict:
    """Build, then the smoke check; where the smoke check crashes the process (a signal,
    not an exception), rebuild from scratch with the next compiler.

    Note [The compiler that builds the GPU check]
    A compiler whose C++ runtime differs from the one the interpreter loads can build an
    extension that imports and runs its kernels, and still dies on the first error message
    it formats: the build is only good once an error has crossed into Python. So each
    compiler is tried in turn (compilers()) until the smoke check passes or fails as an
    ordinary error, and the record says which compiler built the extension that was tested.
    """
    build_env = dict(run_env, PYCOMM_CUDA="1", MAX_JOBS=str(env["cpus"] or 4),
                     TORCH_CUDA_ARCH_LIST=run_env.get("TORCH_CUDA_ARCH_LIST",
                                                      env["capability"]))
    attempts, secs, rc = [], 0.0, 1
    for i, cxx in enumerate(compilers(run_env) or [None]):
        if i:
            shutil.rmtree(BUILD, ignore_errors=True)
        cenv = dict(build_env, **({"CXX": cxx} if cxx else {}))
        rc, more, _ = _run([sys.executable, "setup.py", "build_ext", "--inplace"],
                           logs / "build.log", cenv, TIMEOUT_S["build"])
        secs += more
        attempt = {"cxx": cxx, "build_rc": rc}
        if rc == 0:
            rc, more, _ = _run([sys.executable, "-c", SMOKE], logs / "build.log", run_env, 120)
            secs += more
            attempt["smoke_rc"] = rc
        attempts.append(attempt)
        if rc >= 0:  # built and checked, or an ordinary failure: another compiler won't help
            break
    return {"ok": rc == 0, "seconds": round(secs, 1), "arch": build_env["TORCH_CUDA_ARCH_LIST"],
            "cxx": attempts[-1]["cxx"], "attempts": attempts}


def _pytest_counts(out: str) -> dict:
    last = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected)", last[-1] if last else "")}
    counts["failures"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return counts


def crashed_test(out: str) -> str | None:
    """The test function a crashed pytest was in, from faulthandler's stack (innermost
    test_ frame of the main thread), or None."""
    stack = out.split("Fatal Python error", 1)[1] if "Fatal Python error" in out else ""
    names = re.findall(r'File "[^"]*/tests/[^"]*", line \d+ in (test_\w+)', stack)
    return names[0] if names else None


def _without(argv: list[str], tests: list[str]) -> list[str]:
    """argv with `tests` (function names) deselected through -k."""
    if not tests:
        return argv
    expr = " and ".join(f"not {t}" for t in tests)
    if "-k" in argv:
        i = argv.index("-k") + 1
        return argv[:i] + [f"({argv[i]}) and {expr}"] + argv[i + 1:]
    return argv[:-1] + ["-k", expr, argv[-1]]


def step_tests(env: dict, logs: Path, run_env: dict) -> dict:
    """Each pytest command; where one crashes the process (a signal), the test it crashed in
    is recorded and the command run again without it (twice at most), so that one crash
    does not hide the tests after it."""
    result = {"ok": True, "seconds": 0.0, "runs": []}
    for argv in TESTS:
        argv = [a.format(py=sys.executable) for a in argv]
        crashed: list[str] = []
        while True:
            run_argv = _without(argv, crashed)
            rc, secs, out = _run(run_argv, logs / "tests.log",
                                 dict(run_env, PYCOMM_REQUIRE_CUDA="1"), TIMEOUT_S["tests"])
            result["seconds"] = round(result["seconds"] + secs, 1)
            test = crashed_test(out) if rc < 0 else None
            if test is None or test in crashed or len(crashed) == 2:
                break
            crashed.append(test)
        counts = _pytest_counts(out)
        counts["failures"] += [f"{t} (crashed the process)" for t in crashed]
        if rc < 0:
            counts["failures"].append(f"{test or 'a test'} crashed the process (signal {-rc}); "
                                      "the tests after it did not run")
        result["runs"].append({"command": " ".join(run_argv[1:]), "rc": rc, **counts})
        result["ok"] &= rc == 0 and not crashed
    return result


def step_bench(env: dict, logs: Path, run_env: dict) -> dict:
    result = {"ok": True, "seconds": 0.0, "runs": []}
    for name, args in BENCHES:
        out_json = logs / f"{name}.json"
        argv = [sys.executable, "-m", "pycomm.bench", *args, "--json", str(out_json)]
        rc, secs, out = _run(argv, logs / "bench.log", run_env, TIMEOUT_S["bench"])
        data = json.loads(out_json.read_text()) if rc == 0 and out_json.exists() else None
        result["runs"].append({"name": name, "command": "pycomm-bench " + " ".join(args),
                               "rc": rc, "seconds": round(secs, 1),
                               "table": out.strip()[-6000:], "json": data})
        result["ok"] &= rc == 0
        result["seconds"] = round(result["seconds"] + secs, 1)
    for name, args in SCRIPTS:
        argv = [sys.executable, str(REPO / "benchmarks" / args[0]),
                *(a.format(logs=logs) for a in args[1:])]
        rc, secs, out = _run(argv, logs / "bench.log", run_env, TIMEOUT_S["bench"])
        shown = [a.replace("{logs}", "<logs>") for a in args]
        result["runs"].append({"name": name, "command": "python benchmarks/" + " ".join(shown),
                               "rc": rc, "seconds": round(secs, 1),
                               "table": out.strip()[-6000:], "json": None})
        result["ok"] &= rc == 0
        result["seconds"] = round(result["seconds"] + secs, 1)
    traces = sorted(logs.glob("*_trace.json"))
    if traces:  # one archive: the device machine returns few files
        with tarfile.open(logs / "traces.tar.gz", "w:gz") as tar:
            for t in traces:
                tar.add(t, arcname=t.name)
    return result


def markdown(record: dict) -> str:
    env = record["environment"]
    lines = [f"# GPU check, {env['date'][:10]}: {env.get('device') or 'no device'}", "",
             f"Command: `{record['command']}`", "", "| | |", "|---|---|"]
    for key in ("date", "device", "devices", "capability", "memory_gib", "multiprocessors",
                "driver", "torch", "torch_cuda", "nccl", "cudnn", "nvcc", "python", "cpus",
                "commit", "host"):
        if key in env:
            lines.append(f"| {key} | {env[key]} |")
    for name, step in record["steps"].items():
        lines += ["", f"## {name}: {'passed' if step['ok'] else 'FAILED'} "
                      f"({step['seconds']} s)", ""]
        for attempt in step.get("attempts", []):
            lines.append(f"- CXX `{attempt['cxx']}`: build exit {attempt['build_rc']}"
                         + (f", smoke check exit {attempt['smoke_rc']}"
                            if "smoke_rc" in attempt else ""))
        for run in step.get("runs", []):
            if name == "tests":
                lines.append(f"- `{run['command']}`: exit {run['rc']}, " + ", ".join(
                    f"{v} {k}" for k, v in run.items()
                    if k not in ("command", "rc", "failures")))
                lines += [f"  - {f}" for f in run["failures"]]
            else:
                lines += [f"### `{run['command']}` (exit {run['rc']}, {run['seconds']} s)", "",
                          "```", run["table"], "```", ""]
    return "\n".join(lines) + "\n"


def _write(record: dict, record_dir: Path, stem: str, logs: Path) -> None:
    """The record as it stands, and (where $OUT is set) it and the logs copied there."""
    (record_dir / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (record_dir / f"{stem}.md").write_text(markdown(record))
    out = os.environ.get("OUT")
    if out:
        for f in [record_dir / f"{stem}.json", record_dir / f"{stem}.md", *logs.glob("*.log"),
                  *logs.glob("*.txt"), *logs.glob("traces.tar.gz")]:
            shutil.copy(f, out)


def dry_run(env: dict) -> int:
    from pycomm.bench.__main__ import parse

    print(f"gpu_check: plan for {env['device'] or 'a CUDA device'}:")
    print("  build: PYCOMM_CUDA=1 TORCH_CUDA_ARCH_LIST=<the device's> "
          f"{sys.executable} setup.py build_ext --inplace")
    for argv in TESTS:
        print("  tests: PYCOMM_REQUIRE_CUDA=1 python " + " ".join(argv[1:]))
    for name, args in BENCHES:
        parse(args)  # exits 2 naming the argument if a command line went stale
        print(f"  bench: pycomm-bench {' '.join(args)} --json <logs>/{name}.json")
    for name, args in SCRIPTS:
        script = REPO / "benchmarks" / args[0]
        if not script.exists():
            raise SystemExit(f"gpu_check: {name}: {script} is missing")
        print(f"  bench: python benchmarks/{' '.join(args)}".replace("{logs}", "<logs>"))
    here = _capture([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                     "tests/gpu"]).splitlines() or ["(pytest printed nothing)"]
    print("  tests/gpu here: " + "; ".join(ln for ln in here if ln.startswith("SKIPPED"))
          + " -> " + here[-1])
    if env["device"] is None:
        print(f"gpu_check: dry run: no CUDA device found ({env['no_device']}); the plan "
              f"checked out, nothing was built or run on a GPU")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--steps", default=",".join(STEPS), help="comma list of build,tests,bench")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and check it, run nothing on a GPU")
    p.add_argument("--record", default=str(RESULTS),
                   help="folder for the record (default benchmarks/results)")
    ns = p.parse_args(argv)
    steps = [s.strip() for s in ns.steps.split(",") if s.strip()]
    bad = sorted(set(steps) - set(STEPS))
    if bad:
        p.error(f"--steps: unknown {bad}; choose from {','.join(STEPS)}")
    env = environment()
    if ns.dry_run:
        return dry_run(env)
    if env["device"] is None:
        print(f"gpu_check: no CUDA device found: {env['no_device']}. Nothing was built or "
              f"run; on the GPU machine run `python tools/gpu_check.py` (CONTRIBUTING.md, "
              f"The GPU machine).", file=sys.stderr)
        return 2
    stem = f"gpu_check_{env['date'][:10]}_{_slug(env['device'])}"
    record_dir = Path(ns.record)
    logs = record_dir / f"{stem}.logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    run_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [x for x in [os.environ.get("PYTHONPATH")] if x]),
        PYTHONUNBUFFERED="1")
    record = {"command": " ".join([Path(sys.executable).name, "tools/gpu_check.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "environment": env, "steps": {}}
    for name in steps:
        print(f"gpu_check: {name} ...", flush=True)
        record["steps"][name] = globals()[f"step_{name}"](env, logs, run_env)
        print(f"gpu_check: {name} {'passed' if record['steps'][name]['ok'] else 'FAILED'} "
              f"({record['steps'][name]['seconds']} s)", flush=True)
        _write(record, record_dir, stem, logs)  # after each step: a cut-off run keeps it
    print(markdown(record))
    return 0 if all(s["ok"] for s in record["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
