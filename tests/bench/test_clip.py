"""The `pycomm-bench clip` command: the table and JSON carry each method's norm error
against float64, and pycomm's stays at fp32 accumulation noise where torch's drifts."""

from __future__ import annotations

import json

import torch

from pycomm.bench import clip


def test_norm_error_is_against_float64_and_pycomm_stays_at_noise():
    # One 4M-element gradient: torch's single fp32 reduction drifts ~8e-5 at this size
    # (measured on torch 2.13 CPU); pycomm's chunked sums stay at ~1.5e-8.
    errors = clip.norm_errors([torch.randn(1 << 22, generator=torch.Generator().manual_seed(1))])
    assert set(errors) == {"pycomm", "torch-foreach", "torch-loop"}
    assert errors["pycomm"] < 1e-6
    assert errors["torch-foreach"] > 10 * errors["pycomm"]


def test_report_and_json_carry_the_norm_error(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    clip.add_arguments(parser)
    out = tmp_path / "clip.json"
    ns = parser.parse_args(["--device", "cpu", "--case", "1000x1024", "--reps", "2",
                            "--warmup", "1", "--json", str(out)])
    assert clip.main(ns) == 0
    table = capsys.readouterr().out
    assert "normerr" in table and "# Out of bounds values : 0 OK" in table
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["method"] for r in rows} == {"pycomm", "torch-foreach", "torch-loop"}
    assert all(0 <= r["norm_rel_err"] < 1e-3 for r in rows)
    # no device timing on the CPU: null in the JSON, a dash in the table
    assert data["copy_gbps"] > 0 and data["copy_gbps_device"] is None
    assert all(r["device_us"] is None and r["frac_copy_device"] is None for r in rows)
    assert all(line.split()[-2:] == ["-", "-"] for line in table.splitlines()
               if line.startswith("   1000x1024")), table


def test_the_methods_take_turns_going_first():
    from pycomm.bench.clip import rotated

    runs = [rotated(["pycomm", "torch-foreach", "torch-loop"], rep) for rep in range(4)]
    assert runs == [["pycomm", "torch-foreach", "torch-loop"],
                    ["torch-foreach", "torch-loop", "pycomm"],
                    ["torch-loop", "pycomm", "torch-foreach"],
                    ["pycomm", "torch-foreach", "torch-loop"]]


def test_wrong_counts_allow_one_rounding_to_the_gradient_dtype():
    """#wrong compares with exact fp64: a 16-bit clipped gradient and total are rounded
    once to their dtype (fp16's reach its subnormals), and nothing else is allowed."""
    shapes = [(4096,)] * 20 + [(100000,)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rel in (0.5, 1e9):  # clipping active, inactive
            assert clip._count_wrong(shapes, dtype, "cpu", rel) == 0, (dtype, rel)
