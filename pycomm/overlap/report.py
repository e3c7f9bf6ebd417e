"""Per-step overlap reports built from the reducer's raw timelines.

The reducer (C++) records one raw dict per step; this module owns its schema check and
turns it into a `StepReport`: how long backward took, how much time the collectives
occupied, and how much of that was exposed (not hidden behind backward). It does not
record anything itself.

Note [Exposed communication]
A step's communication is the union of its buckets' [launch, done] intervals (two
collectives in flight at once count once). The part of that union that lies after the
last gradient of the step became ready is *exposed*: backward had nothing left to compute,
so the step waited for the network. `overlap` is the hidden fraction, 1 - exposed / comm,
and is 1.0 by convention for a step with no communication (nothing was left exposed).

    backward  |=========compute=========|         |fin|
    bucket 0        |--comm--|                          hidden
    bucket 1                   |----comm--:---|         partly exposed
                                       last ready

Under manual backward finalization (torch 2.15's finalize_backward(), Note [Manual backward
finalization] in csrc/reducer/finalize.cpp) the caller runs work of its own between the last
gradient and its finalize_backward() call: `caller_s` is that window, and
`comm_behind_caller_s` the part of the exposed communication that ran inside it, hidden
behind the caller's work rather than behind backward. Both are 0 for a step finalized by
backward itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_NS = 1e-9
UNUSED = -1  # param_ready_ns value of a parameter that got no gradient this step

_TOP_KEYS = ("step", "rank", "backward_start_ns", "param_ready_ns", "param_names", "buckets",
             "finalize_start_ns", "finalize_end_ns")
_BUCKET_KEYS = ("index", "nbytes", "param_indices", "ready_ns", "launch_ns", "done_ns")


@dataclass(frozen=True)
class BucketRow:
    """One bucket of one step; times in seconds from the step's backward start."""

    index: int
    nbytes: int
    params: tuple[str, ...]
    ready_s: float
    launch_s: float
    done_s: float
    comm_s: float  # done - launch
    exposed_s: float  # the part of [launch, done] after the step's last gradient was ready


@dataclass(frozen=True)
class StepReport:
    """What one step's backward did, and how much of its communication was hidden.

    See Note [Exposed communication].
    """

    step: int
    rank: int
    backward_s: float  # backward start -> finalize end: the whole backward as the caller sees it
    compute_s: float  # backward start -> last gradient ready
    comm_s: float  # union of the buckets' [launch, done] intervals
    exposed_comm_s: float  # communication after the last gradient was ready
    overlap: float  # 1 - exposed / comm, in 0..1
    finalize_s: float
    buckets: tuple[BucketRow, ...]
    caller_s: float = 0.0  # last gradient ready -> the caller's finalize_backward()
    comm_behind_caller_s: float = 0.0  # exposed communication inside that window
    # The raw dict this report was built from: what `replay`, `chrome_trace` and the plots read.
    timeline: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def __str__(self) -> str:
        return format_report(self)


def raw_timeline(step: StepReport | Mapping[str, Any]) -> Mapping[str, Any]:
    """The raw dict behind a report (or the raw dict itself)."""
    return step.timeline if isinstance(step, StepReport) else step


def check_timeline(raw: Mapping[str, Any]) -> None:
    """Raise ValueError naming the step, rank and bucket if `raw` breaks the agreed schema
    or the ordering the reducer guarantees (ready <= launch <= done, finalize in order)."""
    missing = [k for k in _TOP_KEYS if k not in raw]
    if missing:
        raise ValueError(f"timeline is missing keys {missing}")
    where = f"timeline of step {raw['step']} rank {raw['rank']}"
    ready, names = raw["param_ready_ns"], raw["param_names"]
    if len(ready) != len(names):
        raise ValueError(f"{where}: {len(ready)} param_ready_ns for {len(names)} param_names")
    if not raw["buckets"]:
        raise ValueError(f"{where}: no buckets")
    start = raw["backward_start_ns"]
    if any(t != UNUSED and t < start for t in ready):
        raise ValueError(f"{where}: a gradient is ready before backward started")
    for b in raw["buckets"]:
        _check_bucket(where, b, len(ready))
    if not start <= raw["finalize_start_ns"] <= raw["finalize_end_ns"]:
        raise ValueError(f"{where}: finalize ({raw['finalize_start_ns']} -> "
                         f"{raw['finalize_end_ns']}) is not ordered after backward start {start}")


def _check_bucket(where: str, b: Mapping[str, Any], nparams: int) -> None:
    missing = [k for k in _BUCKET_KEYS if k not in b]
    if missing:
        raise ValueError(f"{where}: a bucket is missing keys {missing}")
    what = f"{where}, bucket {b['index']}"
    if b["nbytes"] < 0:
        raise ValueError(f"{what}: negative nbytes {b['nbytes']}")
    bad = [i for i in b["param_indices"] if not 0 <= i < nparams]
    if bad:
        raise ValueError(f"{what}: parameter indices {bad} out of range (0..{nparams - 1})")
    if not b["ready_ns"] <= b["launch_ns"] <= b["done_ns"]:
        raise ValueError(f"{what}: expected ready <= launch <= done, got ready {b['ready_ns']}"
                         f" launch {b['launch_ns']} done {b['done_ns']} (ns)")


def last_ready_ns(raw: Mapping[str, Any]) -> int:
    """When the step's last gradient became ready (its buckets' ready times included, so a
    bucket of unused parameters marked ready at the end counts)."""
    used = [t for t in raw["param_ready_ns"] if t != UNUSED]
    return max(used + [b["ready_ns"] for b in raw["buckets"]])


def union_length(intervals: Sequence[tuple[float, float]], after: float = float("-inf")) -> float:
    """Total length of the union of [a, b] intervals, counting only the part after `after`."""
    total, reach = 0.0, after
    for a, b in sorted(intervals):
        a = max(a, reach)
        if b > a:
            total += b - a
            reach = b
    return total


def step_report(raw: Mapping[str, Any]) -> StepReport:
    """Build the report of one raw timeline (checked first, see `check_timeline`)."""
    check_timeline(raw)
    t0 = raw["backward_start_ns"]
    last = last_ready_ns(raw)
    names = raw["param_names"]
    intervals = [(b["launch_ns"], b["done_ns"]) for b in raw["buckets"]]
    comm_ns = union_length(intervals)
    exposed_ns = union_length(intervals, after=last)
    manual = bool(raw.get("manual_finalization", False))  # absent from older records
    called = raw["finalize_start_ns"]
    caller_ns = max(called - last, 0) if manual else 0
    behind_ns = (exposed_ns - union_length(intervals, after=max(called, last))) if manual else 0
    rows = tuple(
        BucketRow(index=b["index"], nbytes=b["nbytes"],
                  params=tuple(names[i] for i in b["param_indices"]),
                  ready_s=(b["ready_ns"] - t0) * _NS, launch_s=(b["launch_ns"] - t0) * _NS,
                  done_s=(b["done_ns"] - t0) * _NS, comm_s=(b["done_ns"] - b["launch_ns"]) * _NS,
                  exposed_s=union_length([(b["launch_ns"], b["done_ns"])], after=last) * _NS)
        for b in sorted(raw["buckets"], key=lambda b: b["index"]))
    return StepReport(
        step=raw["step"], rank=raw["rank"],
        backward_s=(raw["finalize_end_ns"] - t0) * _NS, compute_s=(last - t0) * _NS,
        comm_s=comm_ns * _NS, exposed_comm_s=exposed_ns * _NS,
        overlap=1.0 - exposed_ns / comm_ns if comm_ns > 0 else 1.0,
        finalize_s=(raw["finalize_end_ns"] - raw["finalize_start_ns"]) * _NS, buckets=rows,
        caller_s=caller_ns * _NS, comm_behind_caller_s=behind_ns * _NS, timeline=raw)


def step_reports(timelines: Sequence[Mapping[str, Any]], recording: bool = True
                 ) -> list[StepReport]:
    """Reports of raw timelines (most recent last, as the reducer returns them); a clear
    error instead of an empty list when the reducer was told not to record."""
    if not recording:
        raise RuntimeError("no step reports: timeline recording is off (record_timeline=False "
                           "in the DDP config); turn it on to see per-step overlap")
    return [step_report(raw) for raw in timelines]


def format_report(r: StepReport) -> str:
    """A few lines for a terminal: the step's totals, then one row per bucket (ms)."""
    lines = [
        f"step {r.step} rank {r.rank}: backward {r.backward_s * 1e3:.2f} ms (compute "
        f"{r.compute_s * 1e3:.2f}, finalize {r.finalize_s * 1e3:.2f}) | comm "
        f"{r.comm_s * 1e3:.2f} ms, exposed {r.exposed_comm_s * 1e3:.2f} ms | overlap "
        f"{r.overlap:.0%}",
        f"{'bucket':>6} {'bytes':>11} {'params':>6} {'ready':>8} {'launch':>8} {'done':>8} "
        f"{'comm':>8} {'exposed':>8}   (ms from backward start)",
    ]
    if r.timeline.get("manual_finalization"):
        lines.insert(1, f"finalize_backward() called {r.caller_s * 1e3:.2f} ms after the last "
                        f"gradient; {r.comm_behind_caller_s * 1e3:.2f} ms of the exposed comm ran "
                        f"behind the caller's work")
    lines += [f"{b.index:>6} {b.nbytes:>11} {len(b.params):>6} {b.ready_s * 1e3:>8.2f} "
              f"{b.launch_s * 1e3:>8.2f} {b.done_s * 1e3:>8.2f} {b.comm_s * 1e3:>8.2f} "
              f"{b.exposed_s * 1e3:>8.2f}" for b in r.buckets]
    return "\n".join(lines)
