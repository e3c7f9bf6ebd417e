"""pycomm-bench's arithmetic, single process: busbw factors and byte counts against
nccl-tests' formulas, size parsing and sweeps, the report's JSON round-trip and table."""

from __future__ import annotations

import csv
import math

import pytest

from pycomm.bench.collective_ops import COLLECTIVES
from pycomm.bench.report import Measure, Meta, Report, Row, format_table, write_csv
from pycomm.bench.sizes import format_size, parse_size, sweep

# nccl-tests' busbw factor per collective (src/*.cu, <Coll>GetBw), written out per world size
# rather than re-derived from the same expression as the code.
NCCL_TESTS_FACTORS = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5,
        "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0},
    3: {"all_reduce": 4 / 3, "all_gather": 2 / 3, "reduce_scatter": 2 / 3, "all_to_all": 2 / 3,
        "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0},
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75,
        "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0},
}


@pytest.mark.parametrize("n", sorted(NCCL_TESTS_FACTORS))
def test_busbw_factors_match_nccl_tests(n):
    for name, factor in NCCL_TESTS_FACTORS[n].items():
        assert COLLECTIVES[name].bus_factor(n) == pytest.approx(factor, rel=1e-12), name


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bandwidths_use_whole_buffer_for_chunked_collectives(n):
    # nccl-tests: size column = max(send, recv) bytes; for all-gather, reduce-scatter and
    # all-to-all that is count x n (count per rank / per peer); algbw = size / time.
    size, seconds = 3 * 4 * 1024 * n, 1e-3
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        coll = COLLECTIVES[name]
        count = coll.count(size, 4, n)
        assert count == 3 * 1024
        assert coll.nbytes(count, 4, n) == size
        algbw, busbw = coll.bandwidths(size, seconds, n)
        assert algbw == pytest.approx(size / seconds / 1e9)
        assert busbw == pytest.approx(algbw * (n - 1) / n)
    ar = COLLECTIVES["all_reduce"]
    assert ar.count(size, 4, n) == size // 4
    assert ar.bandwidths(size, seconds, n)[1] == pytest.approx(size / seconds / 1e9 * 2 *
                                                               (n - 1) / n)


def test_parse_size_accepts_nccl_tests_spellings():
    assert parse_size("8") == 8
    assert parse_size("64K") == 64 << 10
    assert parse_size("128M") == 128 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("256m") == 256 << 20
    assert parse_size("4KB") == 4096
    for bad in ("", "12Q", "-8", "1.5M", "M", "8 M B"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_sweep_and_format():
    assert sweep(4, 64, factor=2) == [4, 8, 16, 32, 64]
    assert sweep(4, 70, factor=4) == [4, 16, 64]
    assert sweep(8, 32, increment=8) == [8, 16, 24, 32]
    with pytest.raises(ValueError):
        sweep(8, 32, factor=2, increment=8)
    with pytest.raises(ValueError):
        sweep(64, 8, factor=2)
    assert [format_size(s) for s in (4, 1024, 3 << 20, 1 << 30, 1000)] == [
        "4", "1K", "3M", "1G", "1000"]


def _report(wrong=0, check=True) -> Report:
    meta = Meta("0.1.0", "2.13.0", "gloo", 2, "cpu", "host", "2026-11-21 07:00 UTC",
                "pycomm-bench collectives -b 8", 5, 20, 20, check, "max", 1)
    m = Measure("in-place", 412.3, 2.54, 2.54, wrong if check else None, 410.1, 455.0, 400.0,
                460.0)
    rows = (Row("all_reduce", 1048576, 262144, "float", "sum", -1, (m,)),
            Row("all_gather", 4096, 512, "half", "none", -1,
                (Measure("out-of-place", 100.0, 0.04, 0.02, 0 if check else None, 99.0,
                         120.0, 90.0, 121.0), m)),
            Row("barrier", 0, 0, "none", "none", -1, (m,)))
    return Report(meta, rows)


@pytest.mark.parametrize("check", [True, False])
def test_json_round_trip(check):
    report = _report(check=check)
    assert Report.from_json(report.to_json()) == report


def test_table_has_nccl_tests_columns_and_footer(tmp_path):
    text = format_table(_report())
    lines = text.splitlines()
    assert any(line.startswith("#") and "size" in line and "busbw" in line and "#wrong" in line
               and "p99" in line for line in lines)
    assert any("(B)" in line and "(elements)" in line and "(GB/s)" in line for line in lines)
    data = [line for line in lines if not line.startswith("#")]
    assert data[0].split()[:5] == ["1048576", "262144", "float", "sum", "-1"]
    assert "# Out of bounds values : 0 OK" in lines
    # Avg bus bandwidth: mean over the measurements with data (the barrier row has none).
    assert f"# Avg bus bandwidth    : {(2.54 + 0.02 + 2.54) / 3:.4f}" in lines
    assert "FAILED" in format_table(_report(wrong=3))
    path = tmp_path / "r.csv"
    write_csv(_report(), str(path))
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 4
    assert math.isclose(float(rows[0]["busbw"]), 2.54)
