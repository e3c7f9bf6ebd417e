"""What-if tables: one recorded step replayed over many networks, world sizes and caps.

Answers "which bucket cap would this model want on 256 GPUs at 200 Gb/s?" from a step
recorded on the machine at hand (see Note [Replay rules] in replay.py for what is kept and
what is modelled).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .model import AlphaBeta
from .replay import Prediction, WireCost, replay


@dataclass(frozen=True)
class WhatIf:
    network: str
    world_size: int
    cap_bytes: Optional[int]  # None: the recorded buckets
    prediction: Prediction


def what_if(raw: Mapping[str, Any], networks: Mapping[str, AlphaBeta],
            world_sizes: Sequence[int], caps: Sequence[Optional[int]] = (None,), *,
            param_nbytes: Optional[Sequence[int]] = None,
            first_cap_bytes: Optional[int] = None,
            wire: str | WireCost = "fp32") -> list[WhatIf]:
    """Replay `raw` for every (network, world size, cap); cap None keeps the recorded
    buckets; `wire` is what the buckets cross the network in (DDPConfig.wire), or a
    WireCost that names it with its cost (replay's `wire`)."""
    return [WhatIf(name, n, cap, replay(raw, model, n, cap_bytes=cap,
                                        first_cap_bytes=first_cap_bytes if cap else None,
                                        param_nbytes=param_nbytes, wire=wire))
            for name, model in networks.items() for n in world_sizes for cap in caps]


def _cap_label(cap: Optional[int]) -> str:
    return "recorded" if cap is None else f"{cap / 2**20:g} MiB"


def _cell(p: Prediction) -> str:
    return f"{p.backward_s * 1e3:>8.1f} /{p.exposed_comm_s * 1e3:>7.1f}"


def format_what_if(rows: Sequence[WhatIf]) -> str:
    """One line per (network, world size): predicted backward and exposed communication per
    cap (ms), and the cap with the shortest predicted backward."""
    caps = list(dict.fromkeys(r.cap_bytes for r in rows))
    head = f"{'network':>16} {'world':>6} " + " ".join(f"{_cap_label(c):>17}" for c in caps)
    lines = [head + f" {'best cap':>10}",
             f"{'':>16} {'':>6} " + " ".join(f"{'bwd / exposed ms':>17}" for _ in caps)]
    groups: dict[tuple[str, int], list[WhatIf]] = {}
    for r in rows:
        groups.setdefault((r.network, r.world_size), []).append(r)
    for (network, n), group in groups.items():
        cells = " ".join(_cell(r.prediction) for r in group)
        # Rounded to the us so that equal predictions tie, and a tie goes to the first cap.
        best = min(group, key=lambda r: round(r.prediction.backward_s, 6))
        lines.append(f"{network:>16} {n:>6} {cells} {_cap_label(best.cap_bytes):>10}")
    return "\n".join(lines)
