"""Timeline pictures of recorded steps (PNG; matplotlib, pycomm's `plot` extra).

One panel per step, stacked with a shared time axis: a row for backward's compute (with a
tick at each bucket's ready time), one row per bucket for its collective, a line at the
last gradient; the exposed part of communication (after that line) is drawn darker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .report import StepReport, raw_timeline, step_report


def require_matplotlib() -> Any:
    """Import matplotlib with a non-interactive backend, or explain how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("drawing the timeline needs matplotlib: pip install matplotlib "
                           "(pycomm's `plot` extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_step(ax: Any, title: str, step: StepReport | Mapping[str, Any]) -> None:
    r = step_report(raw_timeline(step))
    ms, last = 1e3, r.compute_s * 1e3
    nb = len(r.buckets)
    ax.broken_barh([(0, last)], (nb - 0.4, 0.8), color="tab:blue")
    ax.broken_barh([(last, max(r.backward_s * ms - last, 0))], (nb - 0.4, 0.8),
                   color="tab:gray")
    for row, b in enumerate(reversed(r.buckets)):
        hidden_end = min(b.done_s * ms, last)
        if hidden_end > b.launch_s * ms:
            ax.broken_barh([(b.launch_s * ms, hidden_end - b.launch_s * ms)], (row - 0.4, 0.8),
                           color="tab:green")
        start = max(b.launch_s * ms, last)
        if b.done_s * ms > start:
            ax.broken_barh([(start, b.done_s * ms - start)], (row - 0.4, 0.8), color="tab:red")
        ax.plot([b.ready_s * ms] * 2, [nb - 0.4, nb + 0.4], color="black", linewidth=0.8)
    ax.axvline(last, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(nb + 1), [f"bucket {b.index} ({b.nbytes / 2**20:.1f} MiB)"
                                  for b in reversed(r.buckets)] + ["backward"],
                  fontsize=7 if nb > 12 else 9)
    ax.set_title(f"{title}: backward {r.backward_s * ms:.1f} ms, comm {r.comm_s * ms:.1f} ms, "
                 f"exposed {r.exposed_comm_s * ms:.1f} ms, overlap {r.overlap:.0%}", fontsize=10)


def plot_timelines(panels: Sequence[tuple[str, StepReport | Mapping[str, Any]]], path: str
                   ) -> str:
    """Draw each (title, step) as one panel (a StepReport or a raw timeline) and save the
    PNG at `path`."""
    plt = require_matplotlib()
    heights = [1.2 + 0.28 * (len(raw_timeline(step)["buckets"]) + 1) for _, step in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(10, sum(heights) + 0.6),
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, raw) in zip(axes[:, 0], panels):
        _draw_step(ax, title, raw)
    axes[-1, 0].set_xlabel("ms from backward start (blue: compute, gray: finalize, green: "
                           "hidden comm, red: exposed comm, ticks: bucket complete)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
