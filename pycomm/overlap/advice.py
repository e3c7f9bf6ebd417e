"""Bucket-cap advice from a measured sweep: per-cap summaries, the recommendation rule and
the table. Pure arithmetic on numbers already combined across ranks; measuring is
pycomm/bench/bucket_sweep.py's.

Note [Bucket-cap recommendation]
Caps are measured round-robin, so each round gives every cap a median step time under the
same machine conditions. A cap is recommended over torch's layout (1 MiB first bucket, then
25 MiB) only if its median per-round ratio to torch's is below 1 - MARGIN and it was faster
in more than half of the rounds; otherwise torch's layout stays: on a noisy machine a
single lucky median must not move anyone's bucket cap.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from .model import AlphaBeta

MARGIN = 0.02
TORCH_CAP_MB = 25.0  # stands for torch's layout: a 1 MiB first bucket, then 25 MiB


@dataclass(frozen=True)
class CapResult:
    """One cap: medians over steps of the slowest rank, and the replay's prediction."""

    cap_mb: float
    buckets: int
    step_s: float
    backward_s: float
    comm_s: float
    exposed_comm_s: float
    overlap: float
    vs_torch: float  # median over rounds of (this cap's round median / torch's)
    wins: int  # rounds in which this cap's median step beat torch's
    predicted_backward_s: float
    predicted_exposed_comm_s: float
    same_buckets_as: Optional[float]  # a smaller cap that cut exactly the same buckets


@dataclass(frozen=True)
class SweepResult:
    world_size: int
    rounds: int
    network: AlphaBeta  # an idle all-reduce sweep (or given)
    in_backward: Optional[AlphaBeta]  # fitted to the torch-sized steps; used for predictions
    rows: tuple[CapResult, ...]
    recommended_mb: float
    reason: str


def round_medians(step_s: Sequence[float], rounds: int) -> list[float]:
    """Median step time of each round (steps were taken round by round, equally many)."""
    per = len(step_s) // rounds
    return [statistics.median(step_s[r * per:(r + 1) * per]) for r in range(rounds)]


def paired(cap_rounds: Sequence[float], torch_rounds: Sequence[float]) -> tuple[float, int]:
    """(median ratio to torch, rounds won) of per-round medians."""
    ratios = [c / t for c, t in zip(cap_rounds, torch_rounds)]
    return statistics.median(ratios), sum(r < 1 for r in ratios)


def recommend(rows: Sequence[CapResult], rounds: int) -> tuple[float, str]:
    """The cap to use and why (see Note [Bucket-cap recommendation])."""
    better = [r for r in rows if r.cap_mb != TORCH_CAP_MB and r.same_buckets_as is None
              and r.vs_torch < 1 - MARGIN and r.wins > rounds / 2]
    if not better:
        return TORCH_CAP_MB, (f"no cap beat torch's layout by more than {MARGIN:.0%} in most "
                              "rounds: keep the default")
    best = min(better, key=lambda r: r.vs_torch)
    return best.cap_mb, (f"step {best.vs_torch:.3f}x torch's layout (median of paired rounds), "
                         f"faster in {best.wins} of {rounds} rounds")


def _cap_label(r: CapResult) -> str:
    return "25 (torch)" if r.cap_mb == TORCH_CAP_MB else f"{r.cap_mb:g}"


def format_sweep(result: SweepResult) -> str:
    net, fit = result.network, result.in_backward
    lines = [f"# network, idle all-reduce: alpha {net.alpha_s * 1e6:.0f} us, busbw "
             f"{net.busbw_Bps / 1e9:.2f} GB/s"]
    if fit is not None:
        lines.append(f"# network, as the torch-sized steps saw it (predictions): alpha "
                     f"{fit.alpha_s * 1e6:.0f} us, busbw {fit.busbw_Bps / 1e9:.2f} GB/s")
    lines += [f"#{'cap':>10} {'buckets':>7} {'step':>7} {'vs torch':>8} {'backward':>8} "
              f"{'comm':>7} {'exposed':>7} {'overlap':>7} {'pred bwd':>8} {'pred exp':>8}",
              f"#{'(MiB)':>10} {'':>7} {'(ms)':>7} {'':>8} {'(ms)':>8} {'(ms)':>7} {'(ms)':>7} "
              f"{'':>7} {'(ms)':>8} {'(ms)':>8}"]
    for r in result.rows:
        same = f"  same buckets as {r.same_buckets_as:g}" if r.same_buckets_as else ""
        lines.append(f"{_cap_label(r):>11} {r.buckets:>7} {r.step_s * 1e3:>7.1f} "
                     f"{r.vs_torch:>8.3f} {r.backward_s * 1e3:>8.1f} {r.comm_s * 1e3:>7.1f} "
                     f"{r.exposed_comm_s * 1e3:>7.1f} {r.overlap:>7.0%} "
                     f"{r.predicted_backward_s * 1e3:>8.1f} "
                     f"{r.predicted_exposed_comm_s * 1e3:>8.1f}{same}")
    lines.append(f"# recommended bucket cap: {result.recommended_mb:g} MiB ({result.reason})")
    return "\n".join(lines)
