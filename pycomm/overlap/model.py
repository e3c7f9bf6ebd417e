"""An alpha-beta model of the all-reduce: time = latency + bytes moved / bus bandwidth.

    t(nbytes, n) = alpha * L(n) + (2(n-1)/n) * nbytes / busbw

2(n-1)/n is the all-reduce bus-bandwidth factor (nccl-tests' busbw: a ring moves each byte
that many times through every rank's link), so `busbw` is the per-link bandwidth a
measurement at any world size reports. L(n) says how the latency term grows with the world:
"constant" (L = 1: alpha is the whole collective's latency), "ring" (L = 2(n-1) steps,
NCCL's ring) or "tree" (L = 2 ceil(log2 n), NCCL's tree); alpha is the latency of one such
step. The model is fitted by least squares from `pycomm-bench collectives --json` results,
or given by hand (e.g. `AlphaBeta.from_link(gbit_s=200, latency_us=5, latency="tree")`).
It does not model congestion, protocol switches or contention with compute.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

LATENCY_SCALINGS = ("constant", "ring", "tree")


def allreduce_bus_factor(world_size: int) -> float:
    """Bytes each rank's link carries per byte all-reduced (nccl-tests' busbw factor)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


def latency_steps(world_size: int, latency: str) -> float:
    """L(n): how many latency steps one all-reduce over `world_size` ranks takes."""
    if latency == "constant":
        return 1.0
    if world_size < 2:
        return 0.0
    if latency == "ring":
        return 2.0 * (world_size - 1)
    if latency == "tree":
        return 2.0 * math.ceil(math.log2(world_size))
    raise ValueError(f"latency must be one of {LATENCY_SCALINGS}, got {latency!r}")


@dataclass(frozen=True)
class AlphaBeta:
    """The network: alpha seconds per latency step, busbw bytes/s per link."""

    alpha_s: float
    busbw_Bps: float
    latency: str = "constant"

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or not self.busbw_Bps > 0:
            raise ValueError(f"need alpha_s >= 0 and busbw_Bps > 0, got alpha_s={self.alpha_s}"
                             f" busbw_Bps={self.busbw_Bps}")
        latency_steps(2, self.latency)

    @classmethod
    def from_link(cls, gbit_s: float, latency_us: float, latency: str = "constant"
                  ) -> AlphaBeta:
        """A link of `gbit_s` Gb/s (e.g. 100-400 for InfiniBand/RoCE) and `latency_us` per
        latency step."""
        return cls(alpha_s=latency_us * 1e-6, busbw_Bps=gbit_s * 1e9 / 8, latency=latency)

    def allreduce_s(self, nbytes: int, world_size: int) -> float:
        """Predicted time of one all-reduce of `nbytes` over `world_size` ranks."""
        if world_size == 1:
            return 0.0
        return (self.alpha_s * latency_steps(world_size, self.latency)
                + allreduce_bus_factor(world_size) * nbytes / self.busbw_Bps)

    def with_bandwidth(self, gbit_s: float) -> AlphaBeta:
        return AlphaBeta(self.alpha_s, gbit_s * 1e9 / 8, self.latency)


@dataclass(frozen=True)
class Sample:
    """One measured all-reduce: `nbytes` over `world_size` ranks took `seconds`."""

    nbytes: int
    seconds: float
    world_size: int


def fit_alpha_beta(samples: Iterable[Sample], latency: str = "constant") -> AlphaBeta:
    """Least-squares fit of alpha and 1/busbw to measured all-reduce times.

    The residuals are relative ((model - t) / t): small messages (latency-bound) and large
    ones (bandwidth-bound) weigh alike, where plain least squares would let the largest
    sizes decide alone. Samples may mix world sizes.
    """
    rows = [(latency_steps(s.world_size, latency), allreduce_bus_factor(s.world_size) * s.nbytes,
             s.seconds) for s in samples if s.world_size > 1]
    if len(rows) < 2 or any(t <= 0 for _, _, t in rows):
        raise ValueError("fit_alpha_beta needs at least 2 samples with world_size > 1 and "
                         "positive times")
    # Weighted normal equations for t = alpha * s + beta * x (s latency steps), weights 1 / t^2.
    sll = sum(s * s / t**2 for s, _, t in rows)
    slx = sum(s * x / t**2 for s, x, t in rows)
    sxx = sum(x * x / t**2 for _, x, t in rows)
    slt = sum(s / t for s, _, t in rows)
    sxt = sum(x / t for _, x, t in rows)
    det = sll * sxx - slx * slx
    if det <= 1e-12 * sll * sxx:
        raise ValueError("fit_alpha_beta needs samples of at least two different sizes")
    alpha = (slt * sxx - sxt * slx) / det
    beta = (sll * sxt - slx * slt) / det
    if beta <= 0:
        raise ValueError("fit_alpha_beta: times do not grow with size; cannot fit a bandwidth")
    if alpha < 0:  # the optimum left the physical region: refit on its edge, alpha = 0
        alpha, beta = 0.0, sxt / sxx
    return AlphaBeta(alpha_s=alpha, busbw_Bps=1.0 / beta, latency=latency)


def relative_errors(model: AlphaBeta, samples: Iterable[Sample]) -> list[float]:
    """(predicted - measured) / measured for each sample."""
    return [(model.allreduce_s(s.nbytes, s.world_size) - s.seconds) / s.seconds
            for s in samples]


def _rows_of(doc: Any) -> tuple[list, Any]:
    if isinstance(doc, list):
        return doc, None
    meta = doc.get("meta", doc)
    for key in ("rows", "results"):
        if isinstance(doc.get(key), list):
            return doc[key], meta.get("world_size", meta.get("world"))
    raise ValueError("no 'rows' or 'results' list in the collectives JSON")


_FLOAT32 = (None, "float", "float32")


def _time_us(row: dict) -> Any:
    """The row's time: flat ("time_us") or per placement ("measures", in-place preferred:
    the reducer all-reduces its buckets in place)."""
    measures = row.get("measures")
    if not measures:
        return row.get("time_us")
    chosen = next((m for m in measures if m.get("placement") == "in-place"), measures[0])
    return chosen.get("time_us")


def load_collectives_json(path: str | os.PathLike, world_size: int | None = None
                          ) -> list[Sample]:
    """Float32 sum all-reduce samples from a `pycomm-bench collectives --json` file.

    A row needs its size in bytes ("size") and a time in microseconds ("time_us", or per
    placement under "measures"); rows of other collectives, dtypes or ops are skipped. The
    world size comes from the file ("world" in "meta"), or `world_size` when it does not say.
    """
    with open(path) as f:
        rows, file_world = _rows_of(json.load(f))
    samples = []
    for row in rows:
        if (row.get("collective", "all_reduce") != "all_reduce" or row.get("type") not in _FLOAT32
                or row.get("redop", "sum") != "sum"):
            continue
        time_us, n = _time_us(row), row.get("world_size", file_world or world_size)
        if time_us is None or "size" not in row or n is None:
            raise ValueError(f"{os.fspath(path)}: row {row} lacks size, time_us or a world size")
        samples.append(Sample(nbytes=int(row["size"]), seconds=time_us * 1e-6, world_size=int(n)))
    if not samples:
        raise ValueError(f"{os.fspath(path)}: no float32 sum all_reduce rows")
    return samples
