"""Hand-built raw timelines (the reducer's agreed schema) for the overlap tests."""

from __future__ import annotations

import random

MS = 1_000_000  # ns


def two_bucket_timeline() -> dict:
    """The hand-computed example (ns from an arbitrary clock origin of 5 s):

    p0 (4 MB) ready at 10 ms, p1 (2 MB) at 12 ms; bucket 0 = {p0}, bucket 1 = {p1}.
    Recorded: b0 launched 10 ms, done 16 ms; b1 launched 12 ms, done 19 ms; finalize from
    12.5 ms to 20 ms (it waited for b1 until 19 ms, then worked 1 ms).
    """
    t0 = 5_000 * MS
    return {
        "step": 7, "rank": 0, "backward_start_ns": t0,
        "param_ready_ns": [t0 + 10 * MS, t0 + 12 * MS], "param_names": ["fc2.weight", "fc1.weight"],
        "buckets": [
            {"index": 0, "nbytes": 4_000_000, "param_indices": [0], "ready_ns": t0 + 10 * MS,
             "launch_ns": t0 + 10 * MS, "done_ns": t0 + 16 * MS},
            {"index": 1, "nbytes": 2_000_000, "param_indices": [1], "ready_ns": t0 + 12 * MS,
             "launch_ns": t0 + 12 * MS, "done_ns": t0 + 19 * MS},
        ],
        "finalize_start_ns": t0 + 12 * MS + MS // 2, "finalize_end_ns": t0 + 20 * MS,
    }


def random_timeline(seed: int, step: int = 0, rank: int = 0, n_params: int = 12,
                    cap_bytes: int = 3 << 20, comm_ns=None) -> tuple[dict, list[int]]:
    """A valid random step: parameters ready one after another, bucketed by cap in ready
    order, collectives serialized in index order. `comm_ns(nbytes)` gives each collective's
    duration (default: random); returns (raw, param_nbytes)."""
    rng = random.Random(seed)
    t0 = rng.randrange(1, 10**12)
    nbytes = [4 * rng.randrange(1, 1 << 19) for _ in range(n_params)]
    unused = {i for i in range(n_params) if rng.random() < 0.1}
    t, ready = t0, []
    for i in range(n_params):
        t += rng.randrange(0, 3 * MS)
        ready.append(-1 if i in unused else t)
    last = max([r for r in ready if r != -1], default=t0)
    buckets, current, size = [], [], 0
    for i in range(n_params):
        current.append(i)
        size += nbytes[i]
        if size >= cap_bytes or i == n_params - 1:
            buckets.append((current, size))
            current, size = [], 0
    rows, launch, free = [], t0, t0
    for k, (params, size) in enumerate(buckets):
        b_ready = max(last if ready[i] == -1 else ready[i] for i in params)
        launch = max(launch, b_ready) + (0 if comm_ns else rng.randrange(0, MS // 10))
        start = max(launch, free)
        free = start + (comm_ns(size) if comm_ns else rng.randrange(MS // 10, 8 * MS))
        rows.append({"index": k, "nbytes": size, "param_indices": params, "ready_ns": b_ready,
                     "launch_ns": launch, "done_ns": free})
    fin_start = last + (0 if comm_ns else rng.randrange(0, MS))
    raw = {"step": step, "rank": rank, "backward_start_ns": t0, "param_ready_ns": ready,
           "param_names": [f"layers.{i}.weight" for i in range(n_params)], "buckets": rows,
           "finalize_start_ns": fin_start, "finalize_end_ns": max(fin_start, free) + MS // 5}
    return raw, nbytes
