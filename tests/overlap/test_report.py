"""StepReport and the Chrome trace, on hand-built raw timelines (no reducer needed)."""

import copy
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from pycomm.overlap import (
    chrome_trace,
    format_report,
    step_report,
    step_reports,
    write_chrome_trace,
)
from pycomm.overlap.report import check_timeline, union_length
from tests.support.multirank import run_ranks
from tests.support.overlap_timelines import MS, random_timeline, two_bucket_timeline


def _ms(seconds):
    # Reports are in seconds, built from integer ns: exact to the nanosecond.
    return round(seconds * 1e9) / MS


def test_hand_computed_report():
    r = step_report(two_bucket_timeline())
    assert (r.step, r.rank) == (7, 0)
    assert _ms(r.compute_s) == 12  # last gradient at 12 ms
    assert _ms(r.comm_s) == 9  # [10, 16] U [12, 19]
    assert _ms(r.exposed_comm_s) == 7  # 12 -> 19
    assert r.overlap == pytest.approx(2 / 9, abs=1e-12)
    assert _ms(r.finalize_s) == 7.5 and _ms(r.backward_s) == 20
    assert [b.params for b in r.buckets] == [("fc2.weight",), ("fc1.weight",)]
    assert [_ms(b.exposed_s) for b in r.buckets] == [4, 7]
    assert [(_ms(b.ready_s), _ms(b.launch_s), _ms(b.done_s)) for b in r.buckets] == [
        (10, 10, 16), (12, 12, 19)]
    assert r.nbytes == 6_000_000


@pytest.mark.parametrize("seed", range(200))
def test_invariants_on_random_steps(seed):
    raw, nbytes = random_timeline(seed)
    r = step_report(raw)
    for b in r.buckets:
        assert b.launch_s >= b.ready_s and b.done_s >= b.launch_s
        assert 0 <= b.exposed_s <= b.comm_s
    assert 0 <= r.exposed_comm_s <= r.comm_s <= sum(b.comm_s for b in r.buckets) + 1e-12
    assert 0 <= r.overlap <= 1
    assert r.nbytes == sum(nbytes)
    assert r.backward_s >= r.compute_s >= 0 and r.finalize_s >= 0
    assert sorted(p for b in r.buckets for p in b.params) == sorted(raw["param_names"])


def test_unused_parameters_do_not_end_backward():
    raw = two_bucket_timeline()
    raw["param_ready_ns"][1] = -1  # fc1 unused: its bucket is marked ready at 12 ms anyway
    raw["buckets"][1]["ready_ns"] = raw["backward_start_ns"] + 11 * MS
    assert _ms(step_report(raw).compute_s) == 11


def test_no_communication_counts_as_fully_overlapped():
    raw = two_bucket_timeline()
    for b in raw["buckets"]:
        b["launch_ns"] = b["done_ns"] = b["ready_ns"]
    r = step_report(raw)
    assert r.comm_s == 0 and r.exposed_comm_s == 0 and r.overlap == 1.0


def test_union_length_counts_overlaps_once():
    assert union_length([(0, 4), (2, 6), (8, 9)]) == 7
    assert union_length([(0, 4), (2, 6), (8, 9)], after=5) == 2
    assert union_length([]) == 0


@pytest.mark.parametrize("corrupt, message", [
    (lambda r: r.pop("finalize_end_ns"), r"missing keys \['finalize_end_ns'\]"),
    (lambda r: r["buckets"][1].update(launch_ns=r["buckets"][1]["ready_ns"] - 1),
     r"step 7 rank 0, bucket 1: expected ready <= launch <= done"),
    (lambda r: r["buckets"][0].update(done_ns=r["buckets"][0]["launch_ns"] - 1),
     r"bucket 0: expected ready <= launch <= done"),
    (lambda r: r["buckets"][0].update(param_indices=[5]), r"bucket 0: parameter indices \[5\]"),
    (lambda r: r["param_names"].pop(), r"2 param_ready_ns for 1 param_names"),
    (lambda r: r.update(finalize_end_ns=r["finalize_start_ns"] - 1), r"finalize"),
])
def test_broken_timelines_are_named(corrupt, message):
    raw = two_bucket_timeline()
    corrupt(raw)
    with pytest.raises(ValueError, match=message):
        check_timeline(raw)


def test_format_report_has_a_row_per_bucket():
    report = step_report(two_bucket_timeline())
    text = format_report(report)
    assert str(report) == text
    assert "overlap 22%" in text and "exposed 7.00 ms" in text
    assert len(text.splitlines()) == 2 + 2


_PHASES = {"X", "i", "M"}


def _check_trace_format(doc):
    """The Trace Event Format's rules for the events we emit."""
    assert isinstance(doc["traceEvents"], list)
    for e in doc["traceEvents"]:
        assert e["ph"] in _PHASES and isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["tid"], int)
        if e["ph"] == "i":
            assert e["s"] == "t" and e["ts"] >= 0
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "process_sort_index", "thread_name",
                                 "thread_sort_index"}


def test_trace_has_the_expected_events(tmp_path):
    steps = [random_timeline(seed=3, step=s)[0] for s in range(3)]
    for s, raw in enumerate(steps[1:], 1):  # later steps come later on the clock
        shift = s * 10**10 + steps[0]["backward_start_ns"] - raw["backward_start_ns"]
        _shift(raw, shift)
    path = write_chrome_trace(tmp_path / "t.json", steps)
    doc = json.loads(Path(path).read_text())
    _check_trace_format(doc)
    events = doc["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    nb = len(steps[0]["buckets"])
    assert sorted(e["name"] for e in slices if e["tid"] == 0 and e["name"] != "finalize") == [
        "backward 0", "backward 1", "backward 2"]
    assert len([e for e in slices if e["name"].startswith("all_reduce")]) == 3 * nb
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "backward", **{k + 1: f"bucket {k}" for k in range(nb)}}
    first = min(e["ts"] for e in slices)
    assert first == 0
    ar = next(e for e in slices if e["name"] == "all_reduce 0" and e["args"]["step"] == 2)
    b = steps[2]["buckets"][0]
    assert ar["dur"] == (b["done_ns"] - b["launch_ns"]) / 1e3
    assert ar["args"]["bytes"] == b["nbytes"]


def _shift(raw, ns):
    for key in ("backward_start_ns", "finalize_start_ns", "finalize_end_ns"):
        raw[key] += ns
    raw["param_ready_ns"] = [t if t == -1 else t + ns for t in raw["param_ready_ns"]]
    for b in raw["buckets"]:
        for key in ("ready_ns", "launch_ns", "done_ns"):
            b[key] += ns


def test_trace_merges_ranks_and_aligns_steps():
    r0, r1 = two_bucket_timeline(), copy.deepcopy(two_bucket_timeline())
    r1["rank"] = 1
    _shift(r1, 123 * MS)  # another host's clock
    by_clock = chrome_trace([r0, r1])
    by_step = chrome_trace([r0, r1], align="step")
    _check_trace_format(by_clock)
    procs = {e["pid"]: e["args"]["name"] for e in by_clock["traceEvents"]
             if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}

    def start(doc, pid):
        return min(e["ts"] for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid)

    assert start(by_clock, 1) - start(by_clock, 0) == 123_000  # us
    assert start(by_step, 1) == start(by_step, 0) == 0
    with pytest.raises(ValueError, match="align"):
        chrome_trace([r0], align="wall")


def _gather_trace(rank, world_size, path):
    raw = random_timeline(seed=rank, rank=rank)[0]
    written = write_chrome_trace(path, [raw], all_ranks=True)
    assert (written is not None) == (rank == 0)
    dist.barrier()
    doc = json.loads(Path(path).read_text())
    assert {e["pid"] for e in doc["traceEvents"]} == set(range(world_size))


def test_all_ranks_trace_is_gathered_on_rank_0(tmp_path):
    run_ranks(_gather_trace, world_size=2, path=str(tmp_path / "merged.json"))


def test_timeline_picture(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from pycomm.overlap.plot import plot_timelines

    raw = random_timeline(seed=5)[0]
    path = plot_timelines([("torch-sized", raw), ("recommended", two_bucket_timeline())],
                          str(tmp_path / "t.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot_timelines([("x", raw)], str(tmp_path / "u.png"))


def test_trace_of_reports_equals_trace_of_raw_timelines():
    raws = [random_timeline(seed=s, rank=s)[0] for s in range(2)]
    assert chrome_trace([step_report(r) for r in raws]) == chrome_trace(raws)


def test_step_reports_refuse_when_recording_is_off():
    raws = [random_timeline(seed=s, step=s)[0] for s in range(3)]
    assert [r.step for r in step_reports(raws)] == [0, 1, 2]
    assert step_reports([]) == []
    with pytest.raises(RuntimeError, match="record_timeline=False"):
        step_reports(raws, recording=False)


def test_manual_finalization_window():
    # The hand-computed step, its finalize called by the caller at 17 ms (manual): the
    # caller's window is 12 -> 17 ms, and the exposed communication inside it is 12 -> 17 of
    # [12, 19] (5 ms); 2 ms stay exposed after the call.
    raw = two_bucket_timeline()
    raw.update(manual_finalization=True, finalize_start_ns=raw["backward_start_ns"] + 17 * MS)
    r = step_report(raw)
    assert _ms(r.caller_s) == 5 and _ms(r.comm_behind_caller_s) == 5
    assert _ms(r.exposed_comm_s) == 7  # unchanged: after the last gradient
    assert "finalize_backward() called 5.00 ms after the last gradient; 5.00 ms" in str(r)
    # A call before the last collective's launch window ends covers less of it.
    raw.update(finalize_start_ns=raw["backward_start_ns"] + 13 * MS)
    assert _ms(step_report(raw).comm_behind_caller_s) == 1
    # Finalized by backward itself (or a record from before the flag): no caller window.
    raw.pop("manual_finalization")
    r = step_report(raw)
    assert r.caller_s == 0 and r.comm_behind_caller_s == 0
    assert "finalize_backward() called" not in str(r)
