"""Is my communication overlapped? Reports, traces and a network model built on the
per-step timelines the reducer records (`DistributedDataParallel.step_reports`,
`export_chrome_trace`, `pycomm-bench ddp --sweep-bucket-cap`).

This package only reads timelines; the reducer records them.
"""

from .model import AlphaBeta, Sample, fit_alpha_beta, load_collectives_json, relative_errors
from .replay import (
    Prediction,
    SimBucket,
    WireCost,
    fit_in_backward,
    fit_wire_cost,
    param_nbytes_from,
    rebucket,
    replay,
)
from .report import (
    BucketRow,
    StepReport,
    check_timeline,
    format_report,
    step_report,
    step_reports,
)
from .trace import chrome_trace, write_chrome_trace
from .whatif import WhatIf, format_what_if, what_if

__all__ = [
    "AlphaBeta", "BucketRow", "Prediction", "Sample", "SimBucket", "StepReport", "WhatIf",
    "WireCost", "check_timeline", "chrome_trace", "fit_alpha_beta", "fit_in_backward",
    "fit_wire_cost", "format_report",
    "format_what_if",
    "load_collectives_json", "param_nbytes_from", "rebucket", "relative_errors", "replay",
    "step_report", "step_reports", "what_if", "write_chrome_trace",
]
