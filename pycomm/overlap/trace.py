"""Chrome / Perfetto trace of recorded steps (the JSON "Trace Event Format").

One process per rank; in it one track for backward (a "compute" slice from backward start
to the last gradient, a "finalize" slice, an instant per bucket when it became complete)
and one track per bucket for communication ("wait" from complete to launch when the
launch was held back, then the collective from launch to done). Timestamps are the
reducer's monotonic clock in microseconds from the earliest backward start in the file, so
ranks on one host line up exactly; ranks on different hosts do not share that clock (pass
`align="step"` to line each rank's steps up at their backward start instead).
A timeline that carries pycomm.ZeroRedundancyOptimizer's parameter all-gathers (the
optional keys "param_gathers" and "param_waits", added by pycomm.zero.gathers.attach) also
shows each bucket's all-gather on its track, launched after the previous step, and a
"forward waits" track with what the forward waited for.
Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .report import StepReport, check_timeline, last_ready_ns, raw_timeline

_BACKWARD_TID = 0  # bucket k's track is tid k + 1
_WAITS_TID = 1 << 20  # the forward's waits for parameter all-gathers, below the buckets


def _meta(pid: int, tid: Optional[int], name: str, value: Any) -> dict:
    event = {"ph": "M", "pid": pid, "name": name, "args": {"name" if isinstance(value, str)
                                                            else "sort_index": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(pid: int, tid: int, name: str, start_ns: int, end_ns: int, origin_ns: int,
           **args: Any) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": "pycomm",
            "ts": (start_ns - origin_ns) / 1e3, "dur": (end_ns - start_ns) / 1e3, "args": args}


def _step_events(raw: Mapping[str, Any], origin_ns: int) -> list[dict]:
    pid, step = raw["rank"], raw["step"]
    last = last_ready_ns(raw)
    events = [_slice(pid, _BACKWARD_TID, f"backward {step}", raw["backward_start_ns"], last,
                     origin_ns, step=step),
              _slice(pid, _BACKWARD_TID, "finalize", max(raw["finalize_start_ns"], last),
                     max(raw["finalize_end_ns"], last), origin_ns, step=step)]
    for b in raw["buckets"]:
        tid, k = b["index"] + 1, b["index"]
        args = {"step": step, "bytes": b["nbytes"], "params": len(b["param_indices"]),
                "in_place": bool(b.get("in_place", False))}
        events.append({"ph": "i", "s": "t", "pid": pid, "tid": _BACKWARD_TID,
                       "name": f"bucket {k} ready", "cat": "pycomm",
                       "ts": (b["ready_ns"] - origin_ns) / 1e3, "args": args})
        if b["launch_ns"] > b["ready_ns"]:
            events.append(_slice(pid, tid, "wait", b["ready_ns"], b["launch_ns"], origin_ns,
                                 **args))
        events.append(_slice(pid, tid, f"all_reduce {k}", b["launch_ns"], b["done_ns"],
                             origin_ns, **args))
    for g in raw.get("param_gathers", ()):
        events.append(_slice(pid, g["bucket"] + 1, f"all_gather {g['bucket']}",
                             g["launch_ns"], g["done_ns"], origin_ns, step=step))
    for w in raw.get("param_waits", ()):
        events.append(_slice(pid, _WAITS_TID, f"wait params {w['bucket']}", w["start_ns"],
                             w["end_ns"], origin_ns, step=step))
    return events


def _track_names(timelines: Sequence[Mapping[str, Any]]) -> list[dict]:
    events, seen = [], set()
    for raw in timelines:
        pid = raw["rank"]
        if pid not in seen:
            seen.add(pid)
            events += [_meta(pid, None, "process_name", f"rank {pid}"),
                       _meta(pid, None, "process_sort_index", pid),
                       _meta(pid, _BACKWARD_TID, "thread_name", "backward"),
                       _meta(pid, _BACKWARD_TID, "thread_sort_index", 0)]
            if raw.get("param_waits"):
                events += [_meta(pid, _WAITS_TID, "thread_name", "forward waits"),
                           _meta(pid, _WAITS_TID, "thread_sort_index", _WAITS_TID)]
        for b in raw["buckets"]:
            if (pid, b["index"]) not in seen:
                seen.add((pid, b["index"]))
                events += [_meta(pid, b["index"] + 1, "thread_name", f"bucket {b['index']}"),
                           _meta(pid, b["index"] + 1, "thread_sort_index", b["index"] + 1)]
    return events


def chrome_trace(steps: Sequence[StepReport | Mapping[str, Any]], align: str = "clock"
                 ) -> dict:
    """The trace (a JSON-ready dict) of recorded steps (StepReports or raw timelines) from
    one or several ranks.

    align: "clock" keeps the shared monotonic clock (ranks on one host); "step" shifts each
    rank so that its first recorded step starts at 0 (ranks on different hosts).
    """
    if align not in ("clock", "step"):
        raise ValueError(f"align must be 'clock' or 'step', got {align!r}")
    timelines = [raw_timeline(s) for s in steps]
    for raw in timelines:
        check_timeline(raw)
    starts: dict[int, int] = {}
    for raw in timelines:
        r = raw["rank"]
        starts[r] = min(starts.get(r, raw["backward_start_ns"]), raw["backward_start_ns"])
    first = min(starts.values(), default=0)
    events = _track_names(timelines)
    for raw in timelines:
        origin = starts[raw["rank"]] if align == "step" else first
        events += _step_events(raw, origin)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "pycomm.overlap", "clock": align}}


def write_chrome_trace(path: str | os.PathLike, steps: Sequence[StepReport | Mapping[str, Any]],
                       *,
                       all_ranks: bool = False, group: Any = None, align: str = "clock"
                       ) -> Optional[str]:
    """Write the trace of `steps` (StepReports or raw timelines) to `path`; return the path
    written, or None on ranks that did not write.

    With all_ranks=True this is a collective over `group` (default: the world): every rank
    must call it; the group's rank 0 gathers every rank's timelines (pycomm.objects.gather_object)
    and writes one merged file.
    """
    timelines = [dict(raw_timeline(s)) for s in steps]
    if all_ranks:
        import torch.distributed as dist

        from ..objects import gather_object

        if not dist.is_initialized():
            raise RuntimeError("write_chrome_trace(all_ranks=True) needs an initialized "
                               "process group")
        gathered = gather_object(timelines, 0, group=group)
        if gathered is None:
            return None
        timelines = [raw for per_rank in gathered for raw in per_rank]
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines, align=align), f)
    return os.fspath(path)
