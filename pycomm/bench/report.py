"""Results of `pycomm-bench collectives` and their forms: nccl-tests' table (with p50/p99/
min/max added), JSON (round-trips to the same frozen dataclasses), CSV and a PNG plot.
Measuring lives in collectives.py; this file only holds and writes what was measured."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, fields
from typing import Optional

SCHEMA = "pycomm-bench/collectives/1"


@dataclass(frozen=True)
class Measure:
    """One placement (out-of-place or in-place) of one row, combined across ranks."""
    placement: str
    time_us: float   # mean per call, back-to-back loop
    algbw: float     # GB/s
    busbw: float     # GB/s
    wrong: Optional[int]  # None when the check was off
    p50_us: float
    p99_us: float
    min_us: float
    max_us: float


@dataclass(frozen=True)
class Row:
    collective: str
    size: int        # bytes; 0 for latency-only rows (barrier)
    count: int       # elements
    type: str
    redop: str       # "none" for collectives without a reduction
    root: int        # -1 for collectives without a root
    measures: tuple[Measure, ...]


@dataclass(frozen=True)
class Meta:
    pycomm: str
    torch: str
    backend: str
    world: int
    device: str
    host: str
    date: str
    command: str
    warmup: int
    iters: int
    samples: int
    check: bool
    ranks: str       # how per-rank times were combined: "max" or "avg"
    threads: Optional[int]


@dataclass(frozen=True)
class Report:
    meta: Meta
    rows: tuple[Row, ...]

    @property
    def wrong(self) -> int:
        return sum(m.wrong or 0 for r in self.rows for m in r.measures)

    @property
    def avg_busbw(self) -> float:
        """nccl-tests' footer: the mean busbw over every printed measurement."""
        bws = [m.busbw for r in self.rows if r.size for m in r.measures]
        return sum(bws) / len(bws) if bws else 0.0

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        if data.pop("schema", None) != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document")
        rows = tuple(Row(**{**r, "measures": tuple(Measure(**m) for m in r["measures"])})
                     for r in data["rows"])
        return cls(Meta(**data["meta"]), rows)


# ---- the table ------------------------------------------------------------------------
_LEAD = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8),
         ("redop", "", 6), ("root", "", 6))
_GROUP = (("time", "(us)", 9), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7),
          ("#wrong", "", 6), ("p50", "(us)", 9), ("p99", "(us)", 9), ("min", "(us)", 9),
          ("max", "(us)", 9))
_GROUP_WIDTH = sum(w + 1 for _, _, w in _GROUP)


def metadata_lines(meta: Meta, collectives: str) -> str:
    return (f"# pycomm {meta.pycomm} | torch {meta.torch} | backend {meta.backend} | "
            f"world {meta.world} | {meta.device} | host {meta.host} | {meta.date}\n"
            f"# collectives {collectives} | warmup {meta.warmup} | iters {meta.iters} | "
            f"samples {meta.samples} | check {int(meta.check)} | ranks: {meta.ranks} | "
            f"threads {meta.threads if meta.threads else 'default'}\n"
            f"# command: {meta.command}\n"
            f"# time: mean of the back-to-back loop; p50/p99/min/max: per-call samples; "
            f"GB = 1e9 B")


def section_header(collective: str, placements: tuple[str, ...]) -> str:
    lead_width = sum(w + 1 for _, _, w in _LEAD)
    groups = "".join(p.center(_GROUP_WIDTH) for p in placements)
    names = " ".join(f"{n:>{w}}" for n, _, w in _LEAD)
    units = " ".join(f"{u:>{w}}" for _, u, w in _LEAD)
    for _ in placements:
        names += " " + " ".join(f"{n:>{w}}" for n, _, w in _GROUP)
        units += " " + " ".join(f"{u:>{w}}" for _, u, w in _GROUP)
    placement_line = f"#{'':<{lead_width - 1}}{groups}".rstrip()
    return f"#\n# {collective}\n{placement_line}\n#{names[1:]}\n#{units[1:]}"


def format_row(row: Row) -> str:
    lead = (f"{row.size:>12} {row.count:>12} {row.type:>8} {row.redop:>6} {row.root:>6}")
    for m in row.measures:
        wrong = "N/A" if m.wrong is None else str(m.wrong)
        bw = ((f"{'-':>7}", f"{'-':>7}") if not row.size
              else (f"{m.algbw:>7.2f}", f"{m.busbw:>7.2f}"))
        lead += (f" {m.time_us:>9.1f} {bw[0]} {bw[1]} {wrong:>6} {m.p50_us:>9.1f}"
                 f" {m.p99_us:>9.1f} {m.min_us:>9.1f} {m.max_us:>9.1f}")
    return lead


def footer(report: Report) -> str:
    status = "OK" if report.wrong == 0 else "FAILED"
    if not report.meta.check:
        status = "(check off)"
    return (f"# Out of bounds values : {report.wrong} {status}\n"
            f"# Avg bus bandwidth    : {report.avg_busbw:.4f}\n#")


def format_table(report: Report) -> str:
    """The whole table, as printed while measuring."""
    names = list(dict.fromkeys(r.collective for r in report.rows))
    lines = [metadata_lines(report.meta, ",".join(names))]
    for name in names:
        rows = [r for r in report.rows if r.collective == name]
        lines.append(section_header(name, tuple(m.placement for m in rows[0].measures)))
        lines.extend(format_row(r) for r in rows)
    lines.append(footer(report))
    return "\n".join(lines)


# ---- files ----------------------------------------------------------------------------
_CSV_LEAD = ("collective", "size", "count", "type", "redop", "root")


def write_csv(report: Report, path: str) -> None:
    """One line per (row, placement)."""
    measure_fields = [f.name for f in fields(Measure)]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*_CSV_LEAD, *measure_fields])
        for r in report.rows:
            for m in r.measures:
                out.writerow([getattr(r, k) for k in _CSV_LEAD]
                             + ["" if getattr(m, k) is None else getattr(m, k)
                                for k in measure_fields])


def write_plot(report: Report, path: str) -> None:
    """Bus bandwidth and latency against size, log scales, one line per series."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, Measure]]] = {}
    for r in report.rows:
        if not r.size:  # latency-only rows (barrier)
            continue
        for m in r.measures:
            series.setdefault(f"{r.collective} {r.type} {r.redop} {m.placement}", []).append(
                (r.size, m))
    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in series.items():
        sizes = [s for s, _ in points]
        bw_ax.plot(sizes, [m.busbw for _, m in points], marker=".", label=label)
        lat_ax.plot(sizes, [m.time_us for _, m in points], marker=".", label=label)
    m = report.meta
    for ax, ylabel in ((bw_ax, "bus bandwidth (GB/s)"), (lat_ax, "time per call (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (B)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    lat_ax.legend(fontsize="small")
    fig.suptitle(f"pycomm-bench: {m.backend}, {m.world} ranks, {m.device}, torch {m.torch}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
