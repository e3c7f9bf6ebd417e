"""When pycomm.ZeroRedundancyOptimizer's parameter all-gathers ran, and how long the
forward waited for them: per step, each bucket's launch and completion and each wait (a
module's pre-hook, or anything else that reads the parameters). What is reported from it:
the share of the all-gathers' time that nothing waited for (hidden behind the forward), and
Chrome trace spans (pycomm-bench ddp --trace)."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any, Optional


@dataclasses.dataclass
class StepGathers:
    """One step's all-gathers, times in perf_counter_ns."""
    step: int
    launched: dict[int, int] = dataclasses.field(default_factory=dict)
    done: dict[int, int] = dataclasses.field(default_factory=dict)  # set on the comm thread
    waits: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    def complete(self) -> bool:
        return bool(self.launched) and len(self.done) == len(self.launched)

    def span_ns(self) -> int:
        return max(self.done.values()) - min(self.launched.values())

    def blocked_ns(self) -> int:
        return sum(end - start for _, start, end in self.waits)


class GatherLog:
    """The last `keep` steps' all-gathers."""

    def __init__(self, keep: int = 64):
        self._steps: collections.deque[StepGathers] = collections.deque(maxlen=keep)
        self._count = 0

    def begin_step(self) -> None:
        self._steps.append(StepGathers(self._count))
        self._count += 1

    def launched(self, bucket: int, work: Any) -> None:
        record = self._steps[-1]
        record.launched[bucket] = time.perf_counter_ns()

        def done(_future, record=record, bucket=bucket):
            record.done[bucket] = time.perf_counter_ns()

        work.get_future().add_done_callback(done)

    def waited(self, bucket: int, start_ns: int) -> None:
        if self._steps:
            self._steps[-1].waits.append((bucket, start_ns, time.perf_counter_ns()))

    def complete_steps(self, n: Optional[int] = None) -> list[StepGathers]:
        """The last `n` steps whose all-gathers all completed (all of them: None)."""
        done = [s for s in self._steps if s.complete()]
        return done if n is None else done[-n:]

    def report(self, n: int) -> dict[str, float]:
        """Over the last `n` complete steps: medians of the all-gathers' span (first launch
        to last completion) and of the time waited, and the hidden share (1 - waited /
        span, summed over the steps)."""
        steps = self.complete_steps(n)
        if not steps:
            nan = float("nan")
            return {"steps": 0, "gather_ms": nan, "waited_ms": nan, "hidden": nan}
        span = [s.span_ns() for s in steps]
        waited = [min(s.blocked_ns(), s.span_ns()) for s in steps]
        return {"steps": len(steps), "gather_ms": statistics.median(span) / 1e6,
                "waited_ms": statistics.median(waited) / 1e6,
                "hidden": 1.0 - sum(waited) / max(sum(span), 1)}


def attach(timelines: list[Mapping[str, Any]], log: GatherLog) -> list[dict]:
    """The reducer's step timelines (raw dicts, oldest first), each with the parameter
    all-gathers its forward ran behind: the last step's launched before its backward and
    after the previous one's ("param_gathers", "param_waits": the keys pycomm.overlap's
    Chrome trace draws)."""
    out, previous = [], -1
    steps = log.complete_steps()
    for raw in timelines:
        start = raw["backward_start_ns"]
        before = [r for r in steps if previous < min(r.launched.values()) < start]
        gathers, waits = [], []
        if before:
            record = before[-1]
            gathers = [{"bucket": b, "launch_ns": t, "done_ns": record.done[b]}
                       for b, t in record.launched.items()]
            waits = [{"bucket": b, "start_ns": a, "end_ns": e} for b, a, e in record.waits]
        out.append(dict(raw, param_gathers=gathers, param_waits=waits))
        previous = start
    return out
