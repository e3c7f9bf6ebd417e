"""The bucket-cap recommendation rule and the sweep table, on hand-made numbers."""

import pytest

from pycomm.overlap import AlphaBeta
from pycomm.overlap.advice import (
    MARGIN,
    TORCH_CAP_MB,
    CapResult,
    SweepResult,
    format_sweep,
    paired,
    recommend,
    round_medians,
)


def _row(cap, vs_torch, wins, same=None):
    return CapResult(cap_mb=cap, buckets=3, step_s=0.5 * vs_torch, backward_s=0.3,
                     comm_s=0.2, exposed_comm_s=0.05, overlap=0.75, vs_torch=vs_torch,
                     wins=wins, predicted_backward_s=0.31, predicted_exposed_comm_s=0.06,
                     same_buckets_as=same)


def test_round_medians_and_pairing():
    assert round_medians([1, 2, 9, 4, 5, 6], rounds=2) == [2, 5]
    ratio, wins = paired([0.9, 1.2, 0.8], [1.0, 1.0, 1.0])
    assert (ratio, wins) == (0.9, 2)


def test_clear_winner_is_recommended():
    rows = [_row(1, 0.90, 4), _row(4, 0.95, 3), _row(TORCH_CAP_MB, 1.0, 0)]
    cap, why = recommend(rows, rounds=4)
    assert cap == 1 and "0.900x" in why and "4 of 4 rounds" in why


@pytest.mark.parametrize("rows", [
    [_row(1, 1 - MARGIN / 2, 4), _row(TORCH_CAP_MB, 1.0, 0)],  # within the margin
    [_row(1, 0.8, 2), _row(TORCH_CAP_MB, 1.0, 0)],  # a lucky median, won only half the rounds
    [_row(1, 1.0, 0), _row(4, 0.8, 4, same=1), _row(TORCH_CAP_MB, 1.0, 0)],  # same buckets
])
def test_noise_keeps_torchs_layout(rows):
    cap, why = recommend(rows, rounds=4)
    assert cap == TORCH_CAP_MB and "keep the default" in why


def test_sweep_table():
    rows = (_row(1, 0.9, 4), _row(4, 0.9, 4, same=1), _row(TORCH_CAP_MB, 1.0, 0))
    net = AlphaBeta(400e-6, 1e9)
    result = SweepResult(2, 4, net, AlphaBeta(1e-3, 0.1e9), rows, 1, "because")
    lines = format_sweep(result).splitlines()
    assert len(lines) == 2 + 2 + 3 + 1
    assert "busbw 0.10 GB/s" in lines[1]
    assert lines[5].rstrip().endswith("same buckets as 1")
    assert lines[6].split()[:2] == ["25", "(torch)"]
    assert lines[-1] == "# recommended bucket cap: 1 MiB (because)"
    no_fit = SweepResult(2, 4, net, None, rows, 1, "because")
    assert len(format_sweep(no_fit).splitlines()) == len(lines) - 1
