"""Replay a recorded step's gradient-ready times through a network model.

Backward's compute does not depend on the world size in data parallelism (each rank runs
the same per-rank batch), so a step recorded on one machine says when every gradient
becomes ready; the network decides the rest. `replay` keeps the recorded ready times and
finalize work and replaces the recorded collectives by the model's, at any world size and
bandwidth, with the recorded buckets or with buckets re-cut at another cap.

Note [Replay rules]
1. Bucket k launches when it is complete and every bucket before it has launched (the
   reducer launches in index order, the same on every rank).
2. Collectives run one at a time, in launch order (one communication stream).
3. Backward ends when its last gradient is ready; finalize's own work (its recorded time
   less the time it spent waiting for the last collective) runs after both the autograd
   engine reached finalize and the last collective is done.

    ready      b0 ------- b1 -- (last ready)
    network       [ b0 comm ][ b1 comm ]
                                       ^ exposed = done(b1) - last ready
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .model import AlphaBeta, Sample
from .report import UNUSED, StepReport, check_timeline, last_ready_ns, raw_timeline, union_length

_NS = 1e-9


@dataclass(frozen=True)
class SimBucket:
    """A bucket of the replayed step; times in seconds from backward start."""

    index: int
    nbytes: int
    param_indices: tuple[int, ...]
    ready_s: float
    launch_s: float  # complete and its predecessors launched (rule 1)
    start_s: float  # the network took it (rule 2)
    done_s: float


@dataclass(frozen=True)
class Prediction:
    """The replayed step (same meanings as `StepReport`'s fields)."""

    world_size: int
    backward_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    overlap: float
    finalize_s: float
    buckets: tuple[SimBucket, ...]


def fit_in_backward(steps: Sequence[StepReport | Mapping[str, Any]], world_size: int,
                    alpha_s: float, latency: str = "constant") -> AlphaBeta:
    """The network's bandwidth as recorded steps saw it, for a given latency `alpha_s`.

    Per step, the time the network was busy (the union of the buckets' [launch, done]) is
    taken as the sum of the collectives' times under Note [Replay rules] 2, which gives the
    bandwidth; the latency must come from elsewhere (an idle sweep), because the steps'
    buckets all differ in size and count alike. Bucket by bucket inversion would be wrong
    on backends that run several collectives at once (Gloo has 2 threads): only the busy
    total is meaningful there. On a machine where backward's compute competes with
    communication for the cores this is slower than an idle sweep, and it is what a replay
    of those steps needs."""
    busy, moved = 0.0, 0.0
    probe = AlphaBeta(alpha_s, 1.0, latency)
    for step in steps:
        raw = raw_timeline(step)
        buckets = raw["buckets"]
        busy += union_length([(b["launch_ns"], b["done_ns"]) for b in buckets]) * _NS
        busy -= sum(probe.allreduce_s(0, world_size) for _ in buckets)
        moved += sum(probe.allreduce_s(b["nbytes"], world_size) - probe.allreduce_s(0, world_size)
                     for b in buckets)
    if moved <= 0 or busy <= 0:
        raise ValueError("fit_in_backward: the steps moved no bytes, or their collectives took "
                         f"less than the latency alone ({alpha_s * 1e6:.0f} us each)")
    return AlphaBeta(alpha_s, moved / busy, latency)


def param_nbytes_from(step: StepReport | Mapping[str, Any], numels: Sequence[int]) -> list[int]:
    """Each recorded parameter's gradient bytes as its bucket holds them (the bucket's
    element size, which is the reduce dtype's when there is one, times `numels[i]`)."""
    raw = raw_timeline(step)
    if len(numels) != len(raw["param_names"]):
        raise ValueError(f"numels has {len(numels)} entries for {len(raw['param_names'])} "
                         "recorded parameters")
    out = [0] * len(numels)
    for b in raw["buckets"]:
        elements = sum(numels[i] for i in b["param_indices"])
        if elements == 0 or b["nbytes"] % elements:
            raise ValueError(f"bucket {b['index']}: {b['nbytes']} bytes is not a whole "
                             f"element size times its {elements} elements")
        for i in b["param_indices"]:
            out[i] = numels[i] * (b["nbytes"] // elements)
    return out


def rebucket(raw: Mapping[str, Any], param_nbytes: Sequence[int], cap_bytes: int,
             first_cap_bytes: Optional[int] = None) -> list[tuple[int, int, tuple[int, ...]]]:
    """Cut the recorded parameters into new buckets: (ready_ns, nbytes, param_indices) each.

    Parameters are taken in the order their gradients became ready (unused ones last, as
    ready at the end of backward) and a bucket is closed once it holds >= its cap, as torch's
    DDP assigns buckets; `first_cap_bytes` caps the first bucket (torch: 1 MiB).
    """
    if len(param_nbytes) != len(raw["param_ready_ns"]):
        raise ValueError(f"param_nbytes has {len(param_nbytes)} entries for "
                         f"{len(raw['param_ready_ns'])} recorded parameters")
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    end = last_ready_ns(raw)
    ready = [end if t == UNUSED else t for t in raw["param_ready_ns"]]
    order = sorted(range(len(ready)), key=lambda i: (ready[i], i))
    buckets, current, size = [], [], 0
    for i in order:
        current.append(i)
        size += param_nbytes[i]
        cap = first_cap_bytes if first_cap_bytes and not buckets else cap_bytes
        if size >= cap:
            buckets.append((max(ready[j] for j in current), size, tuple(current)))
            current, size = [], 0
    if current:
        buckets.append((max(ready[j] for j in current), size, tuple(current)))
    return buckets


def _recorded_buckets(raw: Mapping[str, Any]) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(b["ready_ns"], b["nbytes"], tuple(b["param_indices"]))
            for b in sorted(raw["buckets"], key=lambda b: b["index"])]


def wire_ratio(wire: str | Any, nbytes: int) -> float:
    """Bytes a float32 bucket of `nbytes` takes on the wire (DDPConfig.wire, or a
    pycomm.Wire) per byte of its own: 1 for "fp32", 0.5 for "bf16", about 0.254 for "int8"
    (its scales included). The sizes are csrc/shm/wire_codec.cpp's, read through the
    extension; a misspelt wire is the same error as DDPConfig's."""
    from .. import _C

    parsed = wire if isinstance(wire, _C.Wire) else _C.Wire(wire)
    if parsed.exact or nbytes < 4:
        return 1.0
    return _C.wire_bytes(parsed, nbytes // 4) / nbytes


@dataclass(frozen=True)
class WireCost:
    """A low-precision wire (DDPConfig.wire) and what it adds to one bucket's all-reduce
    beyond the bytes it sends: its codec's CPU time and its pipeline's extra stage, as
    `alpha_s` per bucket plus `s_per_byte` per float32 byte of the bucket. Fitted by
    fit_wire_cost from the wire's own all-reduces across the hosts being modelled; given to
    replay and what_if as their `wire`. It is what was measured at those hosts and ranks
    per host: replayed at other host counts it is kept as it is, an assumption (each rank's
    codec work shrinks little with more hosts), not a measurement."""

    wire: str
    alpha_s: float
    s_per_byte: float

    def extra_s(self, nbytes: float) -> float:
        return self.alpha_s + self.s_per_byte * nbytes


def fit_wire_cost(wire: str, samples: Sequence[Sample], model: AlphaBeta) -> WireCost:
    """Fit `wire`'s WireCost from all-reduces of float32 buckets in that wire (`samples`:
    each bucket's float32 bytes and the collective's time, world_size the number of hosts)
    on the network `model` describes: least squares of what each took beyond the model's
    time for its bytes on the wire, against the bucket's size. Negative terms are clamped
    to 0 (the wire never saves more than its bytes)."""
    rows = [(s.nbytes, s.seconds - model.allreduce_s(s.nbytes * wire_ratio(wire, s.nbytes),
                                                     s.world_size)) for s in samples]
    if len({n for n, _ in rows}) < 2:
        raise ValueError("fit_wire_cost needs samples of at least two different sizes")
    mean_n = sum(n for n, _ in rows) / len(rows)
    mean_e = sum(e for _, e in rows) / len(rows)
    slope = (sum((n - mean_n) * (e - mean_e) for n, e in rows)
             / sum((n - mean_n) ** 2 for n, _ in rows))
    slope = max(slope, 0.0)
    alpha = mean_e - slope * mean_n
    if alpha < 0:  # refit on the edge, through the origin
        alpha = 0.0
        slope = max(sum(n * e for n, e in rows) / sum(n * n for n, _ in rows), 0.0)
    return WireCost(wire=wire, alpha_s=max(alpha, 0.0), s_per_byte=slope)


def _schedule(buckets, model: AlphaBeta, world_size: int, t0: int,
              wire: str | WireCost = "fp32") -> list[SimBucket]:
    name = wire.wire if isinstance(wire, WireCost) else wire
    out, launch, free = [], float("-inf"), float("-inf")
    for k, (ready_ns, nbytes, params) in enumerate(buckets):
        launch = max(float(ready_ns - t0), launch)
        start = max(launch, free)
        took = model.allreduce_s(nbytes * wire_ratio(name, nbytes), world_size)
        if isinstance(wire, WireCost) and world_size > 1:  # alone, nothing is encoded
            took += wire.extra_s(nbytes)
        free = start + took / _NS
        out.append(SimBucket(k, nbytes, params, (ready_ns - t0) * _NS, launch * _NS,
                             start * _NS, free * _NS))
    return out


def replay(step: StepReport | Mapping[str, Any], model: AlphaBeta, world_size: int, *,
           cap_bytes: Optional[int] = None, first_cap_bytes: Optional[int] = None,
           param_nbytes: Optional[Sequence[int]] = None,
           wire: str | WireCost = "fp32") -> Prediction:
    """Predict a recorded step (a StepReport or its raw timeline) at `world_size` ranks on
    `model`'s network, with the recorded buckets or, given `cap_bytes` (and the parameters'
    sizes), re-cut ones. `wire` (DDPConfig.wire) is what the float32 buckets cross the
    network in: each bucket's bandwidth term shrinks by wire_ratio, its latency stays; a
    WireCost (fit_wire_cost) names the wire and adds what its codec and pipeline take.
    For the hierarchical all-reduce across hosts, `world_size` is the number of hosts and
    `model` the link between them. See Note [Replay rules]. Times are kept in ns
    internally (the clock's unit)."""
    raw = raw_timeline(step)
    check_timeline(raw)
    if cap_bytes is not None and param_nbytes is None:
        raise ValueError("replay with cap_bytes needs param_nbytes (each parameter's "
                         "gradient size in bytes, in the reducer's parameter order)")
    t0 = raw["backward_start_ns"]
    buckets = (rebucket(raw, param_nbytes, cap_bytes, first_cap_bytes) if cap_bytes
               else _recorded_buckets(raw))
    sim = _schedule(buckets, model, world_size, t0, wire)
    last = last_ready_ns(raw) - t0
    fin_start = raw["finalize_start_ns"] - t0
    recorded_done = max(b["done_ns"] for b in raw["buckets"]) - t0
    fin_work = raw["finalize_end_ns"] - t0 - max(fin_start, recorded_done)
    done = max(b.done_s for b in sim) / _NS
    intervals = [(b.launch_s / _NS, b.done_s / _NS) for b in sim]
    comm, exposed = union_length(intervals), union_length(intervals, after=last)
    end = max(fin_start, done) + max(fin_work, 0)
    return Prediction(world_size=world_size, backward_s=end * _NS, compute_s=last * _NS,
                      comm_s=comm * _NS, exposed_comm_s=exposed * _NS,
                      overlap=1.0 - exposed / comm if comm > 0 else 1.0,
                      finalize_s=(end - fin_start) * _NS, buckets=tuple(sim))
