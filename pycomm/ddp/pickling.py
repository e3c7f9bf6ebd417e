"""torch.save / pickle of pycomm's DistributedDataParallel: which of its attributes are
rebuilt rather than pickled (process groups, the C++ reducer and what hangs on it), and
the pickled form of the graph-split state, a plain flag as it always was, so that pickles
written by earlier pycomm releases load and new ones keep the same keys. Rebuilding the
unpickled module's reducer is module.py's __setstate__."""

from __future__ import annotations

import copy

from .compile import GraphSplit

REBUILT = ("process_group", "_runtime", "_delayed", "_graph_split", "_sharder")
"""Attributes left out of the pickle; the unpickled module makes its own (no sharded
optimizer is attached to it)."""


def pickled_state(attrs: dict) -> dict:
    """The module's __dict__ as pickled."""
    state = copy.copy(attrs)
    split = state.get("_graph_split")
    state["_split_refused"] = split is not None and split.refused
    runtime = state.get("_runtime")
    # the reducer's mode (finalization.py), which the unpickled module's reducer takes on
    state["_manual_finalization"] = runtime is not None and runtime.reducer.manual_finalization
    for key in REBUILT:
        state.pop(key, None)
    return state


def unpickled_state(state: dict) -> tuple[dict, GraphSplit, bool]:
    """The pickled state to restore, the graph-split state (not refused where a pickle
    predates the flag) and whether the reducer finalized manually (no, where a pickle
    predates that)."""
    state = dict(state)
    # Pickles from before the delayed all-reduce existed hold neither attribute.
    state.setdefault("_delayed_spec", None)
    state.setdefault("_delayed_names", set())
    manual_finalization = state.pop("_manual_finalization", False)
    return state, GraphSplit(state.pop("_split_refused", False)), manual_finalization
