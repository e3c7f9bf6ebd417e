"""pycomm-bench collectives on real Gloo ranks: every collective, dtype, op and placement
gives torch's result (#wrong 0, checked against the exact values of Note [Exact data]),
and a corrupted result is counted."""

from __future__ import annotations

import os

import pytest

from pycomm.bench.collective_ops import COLLECTIVES
from pycomm.bench.collectives_run import CORRUPT_ENV, DTYPES, OPS, Config, run, skipped
from tests.support.multirank import run_ranks

# Sizes chosen so that counts are odd, not multiples of the pattern periods (5, 251) and
# not divisible by the world size: 4 B is one float32 (and zero elements of all-gather's
# per-rank chunk at n >= 2 for float64, a row the run must skip).
_SIZES = (4, 12, 1000, 6 * 1024 + 12)
_CFG = Config(collectives=tuple(COLLECTIVES), sizes=_SIZES, dtypes=tuple(DTYPES), ops=OPS,
              root=1, warmup=1, iters=2, samples=2)


def _expected_rows(world: int) -> int:
    rows = 0
    for coll in COLLECTIVES.values():
        if not coll.moves_data:
            rows += 1
            continue
        for dtype, (torch_dtype, _) in DTYPES.items():
            for op in OPS if coll.reduces else ("none",):
                if skipped(op, dtype):
                    continue
                rows += sum(coll.count(s, torch_dtype.itemsize, world) > 0 for s in _SIZES)
    return rows


def _all_correct(rank, world_size):
    report = run(_CFG)
    assert len(report.rows) == _expected_rows(world_size)
    for row in report.rows:
        for m in row.measures:
            assert m.wrong == 0, (row, m)
            assert m.time_us > 0 and m.min_us <= m.p50_us <= m.p99_us <= m.max_us
    assert {r.collective for r in report.rows} == set(COLLECTIVES)


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_dtype_op_is_exact(world):
    # 3 ranks on 2 cores: slow but correct; it covers a world size that is not a power of
    # two (avg within 2 ulp) and an all-gather whose chunks are not aligned.
    run_ranks(_all_correct, world, "gloo", deadline_s=120)


def _corruption_counted(rank, world_size):
    os.environ[CORRUPT_ENV] = "0"
    cfg = Config(collectives=tuple(COLLECTIVES), sizes=(64,), dtypes=("float32", "int32"),
                 ops=("sum", "max"), root=0, warmup=0, iters=1, samples=1, ranks_avg=True)
    report = run(cfg)
    assert report.meta.ranks == "avg"
    assert report.wrong > 0
    for row in report.rows:
        for m in row.measures:
            # Rank 0 adds 1 to one element of every result it holds; barrier has none.
            assert m.wrong == (1 if row.size else 0), (row, m)


def test_corrupted_result_is_counted():
    run_ranks(_corruption_counted, 2, "gloo", deadline_s=60)
