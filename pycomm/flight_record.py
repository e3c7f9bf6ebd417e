"""Merge the ranks' flight records of a "pycomm" group and say which rank is behind at
which operation (See Note [Flight recorder] in csrc/shm/flight.cpp).

    python -m pycomm.flight_record DIRECTORY    # the files of $PYCOMM_FLIGHT_RECORD_DIR,
                                                # or of pycomm.shm.dump_flight_record
    python -m pycomm.flight_record DIRECTORY --torch-dir OUT
        # also in torch's flight-recorder format, one directory per group, for
        # python -m torch.distributed.flight_recorder.fr_trace OUT/GROUP --prefix rank_

Each rank's file lists its last operations on the group with their operation number (the
"#N" of pycomm's errors), what they were and how far they got. Ranks run a group's
operations in the same order, so the merge lines them up by number: a rank that issued
fewer is behind (hung, or never got there); ranks whose records differ at one number were
in different collectives there (for pycomm's DDP buckets: a rank one forward ahead
skipped a backward or ran a no_sync micro-step alone).

torch's format (`to_torch`): torch's analyzer reads one pickled dict per rank, the rank
in the file name, and matches collectives by sequence number, kind, sizes, dtypes and
state. pycomm's records map onto it with three limits: the analyzer accepts only its own
backends' names, so the operations are named "gloo:<op>"; a record keeps the bytes of an
operation's outputs, not shapes, so sizes are flat element counts (inputs derived for
all_gather and reduce_scatter, unknown for gather, scatter and all_to_all); sends and
receives are left out (their peers are not recorded). The DDP bucket labels have no place
there: pycomm's own report names a skipped backward, torch's sees matching collectives.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import sys
from collections import defaultdict


def load(directory: str) -> dict[str, list[dict]]:
    """The records in `directory`, by group (the files' common stem), each group's sorted
    by rank."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(directory, "*_rank*.json"))):
        with open(path) as f:
            record = json.load(f)
        if record.get("format") != "pycomm-flight-record-1":
            continue
        groups[os.path.basename(path).rsplit("_rank", 1)[0]].append(record)
    return {g: sorted(rs, key=lambda r: r["rank"]) for g, rs in groups.items()}


def _what(e: dict) -> str:
    text = f"#{e['seq']} {e['op']} of {e['bytes']} bytes ({e['dtype']})"
    if e["bucket"] >= 0:
        text += (f", bucket {e['bucket']} of step {e['step']} after {e['forwards']} "
                 f"forward(s)")
    return text


def _state(e: dict) -> str:
    return f"{e['state']}: {e['error']}" if e["state"] == "failed" else e["state"]


def _same(a: dict, b: dict) -> bool:
    keys = ("op", "bytes", "dtype")
    labels = a["bucket"] >= 0 and b["bucket"] >= 0
    return all(a[k] == b[k] for k in keys) and (
        not labels or (a["bucket"], a["forwards"]) == (b["bucket"], b["forwards"]))


def report(records: list[dict]) -> str:
    """What the ranks' records of one group say, most telling first."""
    by_rank = {r["rank"]: {e["seq"]: e for e in r["entries"]} for r in records}
    world = records[0]["world"] if records else 0
    lines = []
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        lines.append(f"no record from rank(s) {missing} (not written: the rank hung or was "
                     f"killed before its group failed; dump it with "
                     f"pycomm.shm.dump_flight_record)")
    last = {rank: max(es) if es else -1 for rank, es in by_rank.items()}
    furthest = max(last.values(), default=-1)
    behind = sorted(r for r, s in last.items() if s < furthest)
    if behind:
        ahead = [r for r, s in last.items() if s == furthest]
        waited = by_rank[ahead[0]].get(min(last[r] for r in behind) + 1)
        for r in behind:
            mine = by_rank[r].get(last[r])
            lines.append(f"rank {r} is behind: its last operation is "
                         f"{_what(mine) if mine else 'none'} ({_state(mine) if mine else '-'})"
                         f", while rank(s) {ahead} went up to #{furthest}")
        if waited is not None:
            lines.append(f"the ranks ahead waited for it at {_what(waited)} "
                         f"({_state(waited)})")
    problem = bool(missing or behind)
    common = set.intersection(*(set(es) for es in by_rank.values())) if by_rank else set()
    for seq in sorted(common):
        entries = {r: es[seq] for r, es in by_rank.items()}
        first = next(iter(entries.values()))
        if all(_same(first, e) for e in entries.values()):
            continue
        problem = True
        lines.append(f"at operation #{seq} the ranks were in different collectives: " +
                     "; ".join(f"rank {r}: {_what(e)} ({_state(e)})"
                               for r, e in entries.items()))
        forwards = {r: e["forwards"] for r, e in entries.items() if e["bucket"] >= 0}
        if len(set(forwards.values())) > 1:
            top = max(forwards.values())
            extra = [r for r, f in forwards.items() if f == top]
            lines.append(f"rank(s) {extra} ran more forwards since the last synchronized "
                         f"backward than the others: a skipped backward, a no_sync "
                         f"micro-step alone, or a forward with grad enabled the others did "
                         f"not run")
        break
    for r in sorted(by_rank):
        es = by_rank[r]
        done = [s for s, e in es.items() if e["state"] == "completed"]
        open_ = [e for e in es.values() if e["state"] != "completed"]
        lines.append(f"rank {r}: issued up to #{last[r]}, completed up to "
                     f"#{max(done) if done else '-'}" +
                     (f"; first not completed: {_what(open_[0])} ({_state(open_[0])})"
                      if open_ else ""))
    if not problem:
        lines.insert(0, "every rank issued the same operations, the same collectives")
    return "\n".join(lines)


# pycomm's operation -> torch's name for it, and how its input size follows from its
# output's (numel, world): same, divided, multiplied, or unknown (None).
_TORCH_OPS = {
    "all_reduce": ("all_reduce", "same"),
    "all_reduce_coalesced": ("allreduce_coalesced", "same"),
    "broadcast": ("broadcast", "same"),
    "reduce": ("reduce", "same"),
    "barrier": ("barrier", "same"),
    "all_gather": ("all_gather", "divided"),
    "all_gather_into_tensor": ("all_gather", "divided"),
    "reduce_scatter": ("reduce_scatter", "multiplied"),
    "reduce_scatter_tensor": ("_reduce_scatter_base", "multiplied"),
    "gather": ("gather", None),
    "scatter": ("scatter", None),
    "all_to_all": ("all_to_all", None),
    "all_to_all_single": ("all_to_all", None),
}
_TORCH_STATES = {"queued": "scheduled", "started": "started", "completed": "completed",
                 "failed": "failed"}
TORCH_FORMAT_VERSION = "2.10"  # what torch 2.11-2.13 write and their analyzer reads


# torch's Python dtype names (pycomm's records) -> c10's (torch's records)
_C10_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half",
               "bfloat16": "BFloat16", "int64": "Long", "int32": "Int", "int16": "Short",
               "int8": "Char", "uint8": "Byte", "bool": "Bool"}


def _torch_dtype(name: str) -> tuple[str, int]:
    """pycomm's dtype name -> (c10's name, bytes per element); ("Undefined", 0) for none."""
    import torch

    if name not in _C10_DTYPES:
        return "Undefined", 0
    return _C10_DTYPES[name], getattr(torch, name).itemsize


def to_torch(group: str, record: dict) -> dict:
    """One rank's record of `group` as torch's flight recorder writes a rank's dump."""
    world = record["world"]
    entries = []
    for e in record["entries"]:
        if e["op"] not in _TORCH_OPS:  # send, recv: their peers are not recorded
            continue
        name, rule = _TORCH_OPS[e["op"]]
        dtype, size = _torch_dtype(e["dtype"])
        out = e["bytes"] // size if size else 0
        inp = {"same": out, "divided": out // world, "multiplied": out * world}.get(rule)
        in_sizes = [[inp]] if inp is not None else [[]]
        out_sizes = [[out]] if rule is not None else [[]]
        entries.append({
            "record_id": len(entries), "pg_id": 0, "process_group": (group, "pycomm"),
            "collective_seq_id": e["seq"], "p2p_seq_id": 0, "op_id": e["seq"],
            "profiling_name": f"gloo:{name}", "is_p2p": False,
            "input_sizes": in_sizes, "output_sizes": out_sizes,
            "input_dtypes": [dtype], "output_dtypes": [dtype],
            "state": _TORCH_STATES.get(e["state"], e["state"]),
            "time_created_ns": e["queued_ns"],
            "time_discovered_started_ns": e["started_ns"] or None,
            "time_discovered_completed_ns": e["ended_ns"] or None,
            "retired": e["state"] in ("completed", "failed"), "frames": [],
        })
    return {"version": TORCH_FORMAT_VERSION, "comm_lib_version": "pycomm",
            "pg_config": {group: {"name": group, "desc": "pycomm",
                                  "ranks": str(list(range(world)))}},
            "pg_status": {}, "entries": entries}


def write_torch(groups: dict[str, list[dict]], out: str) -> list[str]:
    """Each group's records in torch's format under `out`/GROUP/rank_R; the directories."""
    written = []
    for group, records in groups.items():
        directory = os.path.join(out, group)
        os.makedirs(directory, exist_ok=True)
        for record in records:
            with open(os.path.join(directory, f"rank_{record['rank']}"), "wb") as f:
                pickle.dump(to_torch(group, record), f)
        written.append(directory)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycomm.flight_record",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where the ranks' flight records are")
    parser.add_argument("--torch-dir", metavar="OUT",
                        help="also write them in torch's flight-recorder format, one "
                             "directory per group under OUT, for torch's analyzer")
    args = parser.parse_args(argv)
    groups = load(args.directory)
    if not groups:
        print(f"python -m pycomm.flight_record: no flight records (*_rankN.json) in "
              f"{args.directory}", file=sys.stderr)
        return 2
    for name, records in groups.items():
        print(f"# group {name}: records of rank(s) {[r['rank'] for r in records]} "
              f"of {records[0]['world']}")
        print(report(records))
    if args.torch_dir:
        for directory in write_torch(groups, args.torch_dir):
            print(f"# torch's format: python -m torch.distributed.flight_recorder.fr_trace "
                  f"{directory} --prefix rank_")
    return 0


if __name__ == "__main__":
    sys.exit(main())
