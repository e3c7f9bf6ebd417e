"""`pycomm-bench ddp --compile`: which implementations it times and what it compares (the
timing loop itself runs in tests/bench/test_bucket_sweep.py's sweep and in recorded runs)."""

import ctypes.util
import json
import subprocess
import sys

import pytest
import torch

from pycomm.bench import ddp


def _row(impl, step, exposed, overlap):
    return ddp.Result("mlp", 1, "32 samples", impl, step, step * 0.7, step - exposed, exposed,
                      step, step - exposed, overlap)


def test_compile_times_both_compiled_and_pycomm_eager_for_its_overlap():
    assert ddp.Config().variants() == ("torch", "pycomm")
    assert ddp.Config(compile=True).variants() == ("torch+compile", "pycomm+compile",
                                                   "pycomm")
    assert ddp.Config(impls=("torch",), compile=True).variants() == ("torch+compile",)


def test_compiled_rows_are_compared_with_torch_compiled_and_overlap_with_eager():
    rows = {r.impl: r for r in (_row("torch+compile", 200.0, 80.0, float("nan")),
                                _row("pycomm+compile", 150.0, 20.0, 0.875),
                                _row("pycomm", 160.0, 30.0, 0.8))}
    lines = ddp._comparisons("mlp", rows)
    # The floor is the fastest no_sync step (torch+compile's 200 - 80 ms here).
    assert lines[0] == ("# mlp: floor (the fastest no_sync step, no communication) 120.0 ms: "
                        "torch+compile/floor 1.667, pycomm+compile/floor 1.250, "
                        "pycomm/floor 1.333"), lines
    assert lines[1].startswith("# mlp: pycomm+compile/torch+compile step 0.750,"), lines
    assert "exposed 0.250" in lines[1], lines
    assert lines[-1] == "# mlp: pycomm overlap compiled 0.88 vs eager 0.80 (+0.07)", lines
    assert len(lines) == 3, lines  # eager pycomm has no eager torch row to be compared with


_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "steady":
    from pycomm.bench.common import steady_allocator
    assert steady_allocator() == "malloc mmap threshold 32 MiB, trim 2 GiB"
def cycle():  # a step's gradients: six 16 MiB blocks allocated, written and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(4 << 20) for _ in range(6)]
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print([cycle() for _ in range(6)])
"""


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to tune")
@pytest.mark.parametrize("mode", ["default", "steady"])
def test_steady_allocator_stops_gradient_sized_blocks_faulting_after_the_first_step(mode):
    # See Note [Steady allocator]: the benchmarks' steps must not page-fault over their
    # gradients in some ranks and not others. By default glibc maps them afresh on the
    # second cycle too, and mostly into the fourth or fifth (its mmap threshold is still
    # moving); fixed, the heap settles within three cycles and nothing faults after that.
    # How much the second and third cycles fault varies from run to run and from day to
    # day (2026-11-25, 12 runs: second 4096-24576 pages, third 0-8192; 2026-11-26, 21
    # runs: second 0-24577, third 0-12288, both large in one run), so only the settled
    # cycles (fourth on) are held: to nothing, in every run seen. glibc's default faulted
    # 8192-28640 pages there in 9 runs of 10.
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    faults = eval(out.strip().splitlines()[-1])
    assert faults[0] > 20000, faults  # the first step maps its gradients either way
    if mode == "steady":
        assert sum(faults[3:]) < 1000, faults
    else:
        assert sum(faults[1:]) > 20000, faults  # what the setting is for


def _clipped_steps(rank, world_size):
    import torch
    from torch import nn

    x = torch.randn(4, 8)
    for impl in ("torch", "pycomm"):
        torch.manual_seed(0)
        model = ddp.IMPLS[impl](nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the grads stay as clipped
        for no_sync in (False, True):
            ddp._timed(model, model, opt, x, 2, no_sync, clip_norm=1e-3)
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()]))
            assert norm <= 1e-3 * (1 + 1e-5), (impl, no_sync, norm)


def test_clip_runs_each_implementations_clipping_in_both_modes():
    # --clip: without it these gradients' norm is about 0.6; with it every step's is clipped.
    from tests.support.multirank import run_ranks

    run_ranks(_clipped_steps, 2)


def test_trace_writes_each_pycomm_variants_last_steps(tmp_path):
    # --trace: one Chrome trace per pycomm variant with every rank's last timed steps; the
    # bucket slices say whether the bucket was reduced in place (the default over shared
    # memory) or through its buffer (pycomm_bucketed).
    out = subprocess.run(
        [sys.executable, "-m", "pycomm.bench", "ddp", "--models", "mlp", "--impls",
         "torch,pycomm,pycomm_bucketed", "--reps", "1", "--steps", "2", "--warmup", "1",
         "--samples", "4", "--trace", str(tmp_path / "traces")],  # made by the run
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    traces = tmp_path / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["ddp_mlp_pycomm.json",
                                                        "ddp_mlp_pycomm_bucketed.json"]
    for name, in_place in (("pycomm", True), ("pycomm_bucketed", False)):
        events = json.loads((traces / f"ddp_mlp_{name}.json").read_text())["traceEvents"]
        reduces = [e for e in events if e.get("name", "").startswith("all_reduce")]
        steps = {(e["pid"], e["args"]["step"]) for e in reduces}
        assert {pid for pid, _ in steps} == {0, 1} and len(steps) == 4, steps
        assert {e["args"]["in_place"] for e in reduces} == {in_place}, name
    # Progress on stderr (not a terminal here: a line each), rank 0's only.
    progress = [line for line in out.stderr.splitlines() if line.startswith("# progress:")]
    assert progress == ["# progress: mlp: building and warming up torch",
                        "# progress: mlp: building and warming up pycomm",
                        "# progress: mlp: building and warming up pycomm_bucketed",
                        "# progress: mlp: rep 1 of 1 (torch, pycomm, pycomm_bucketed)"], progress


def test_adamw_compares_the_sharded_implementations(tmp_path):
    # --optimizer adamw: the fast anchors (pycomm's and torch's DDP with torch's fused
    # AdamW, pycomm's DDP with pycomm.optim.AdamW, torch's ZeRO with the fused AdamW),
    # pycomm's ZeroRedundancyOptimizer in both modes and FSDP2 side by side, with
    # optimizer state per rank (the sharded ones hold half at 2 ranks), the step's parts,
    # the bound, and the trace of pycomm_zero shows its all-gathers and what the forward
    # waited for.
    out = subprocess.run(
        [sys.executable, "-m", "pycomm.bench", "ddp", "--models", "mlp", "--optimizer",
         "adamw", "--reps", "1", "--steps", "2", "--warmup", "1", "--samples", "4",
         "--json", str(tmp_path / "r.json"), "--trace", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert list(rows) == ["pycomm_fused", "pycomm_onepass", "pycomm_zero",
                          "pycomm_zero_released", "torch_fused", "torch_zero_fused",
                          "fsdp2"], list(rows)
    whole = rows["pycomm_fused"]["state_mb"]
    assert whole > 200, whole  # AdamW: two fp32 tensors per parameter, 25.2M parameters
    assert rows["torch_fused"]["state_mb"] == rows["pycomm_onepass"]["state_mb"] == whole
    for impl in ("pycomm_zero", "pycomm_zero_released", "torch_zero_fused", "fsdp2"):
        assert abs(rows[impl]["state_mb"] / whole - 0.5) < 0.01, (impl, rows[impl])
    for r in rows.values():  # each part of the step (medians each) within the step
        assert all(0 < r[k] < r["step_ms"] for k in ("forward_ms", "backward_ms", "opt_ms")), r
        assert 0 < r["no_sync_fb_ms"] < r["no_sync_step_ms"] and r["copy_gb_s"] > 0, r
    assert 0.0 <= rows["pycomm_zero"]["gather_hidden"] <= 1.0, rows["pycomm_zero"]
    assert "# mlp: pycomm_zero step against pycomm_fused " in out.stdout, out.stdout
    assert "; the best torch (" in out.stdout, out.stdout
    assert "# mlp: bound = forward + backward floor " in out.stdout, out.stdout
    events = json.loads((tmp_path / "ddp_mlp_pycomm_zero.json").read_text())["traceEvents"]
    gathers = {(e["pid"], e["name"]) for e in events if e["name"].startswith("all_gather")}
    assert gathers == {(pid, f"all_gather {k}") for pid in (0, 1) for k in range(3)}, gathers
    assert any(e["name"].startswith("wait params") for e in events)


@pytest.mark.parametrize("args, says", [
    (["--models", "mlp,foo"], "--models: unknown 'foo'; choose from mlp, transformer"),
    (["--impls", "torch,bar"], "--impls: unknown 'bar'; choose from torch, pycomm"),
    (["--reps", "0"], "--reps: must be at least 1, got 0"),
    (["--impls", "pycomm_fused"], "--impls: pycomm_fused step an AdamW of their own: use them "
                                  "with --optimizer adamw, not sgd"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb: must be positive, got 0"),
    (["--json", "/nonexistent/r.json"], "--json: cannot write '/nonexistent/r.json'"),
    (["--trace", "/nonexistent/traces"], "--trace: cannot write '/nonexistent/traces'"),
    (["--trace", "/etc/hostname"], "--trace: '/etc/hostname' is not a folder"),
    (["--device", "cpu", "--backend", "nccl"], "--device: cpu with --backend nccl"),
    *([(["--device", "cuda"], "--device: cuda asked for, but torch sees no CUDA device")]
      if not torch.cuda.is_available() else []),
])
def test_bad_arguments_are_one_line_before_any_rank_starts(args, says):
    out = subprocess.run([sys.executable, "-m", "pycomm.bench", "ddp", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pycomm-bench ddp: error: "), out.stderr
    assert says in lines[0], lines[0]


def test_cpu_by_thread_script_reports_every_part():
    # benchmarks/ddp_cpu_by_thread.py, shortened: every part of its report is there, with
    # the backward thread's CPU in both modes and a figure for each all-reduce alone.
    import re

    from tests.support.paths import REPO

    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ddp_cpu_by_thread.py"), "--models", "mlp",
         "--samples", "4", "--steps", "2", "--reps", "2"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for words in ("threads synchronized {'python:", "threads no_sync      {'python:",
                  "stats per step {", "gc collections during the synchronized steps: ",
                  "process CPU "):
        assert words in text, text
    assert re.search(r"alone: .* pieces [\d.]+ ms, one buffer [\d.]+ ms", text), text
