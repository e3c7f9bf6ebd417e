"""Every collective pycomm-bench measures, one class each: its buffers, its call, the result
it must produce and its bus-bandwidth factor (nccl-tests' formulas, beside the collective).

Sizes follow nccl-tests: for all-gather, reduce-scatter and all-to-all the size column is
the whole buffer (`count x n` elements, `count` per rank or per peer); algbw = size / time
(GB = 1e9 bytes) and busbw = algbw x `bus_factor(n)`.

Note [Exact data]
Every rank fills its input with small integers, `pattern(rank, i)`, a function of the rank
and of the element's index in the whole buffer, so each rank can compute the exact result
of any collective without communicating. Data-moving collectives use values in
[-125, 125] (period 251, a prime, so chunks of different ranks differ); reductions use
values in [-2, 2], so every partial sum of n ranks is an integer of magnitude <= 2n,
exactly representable (bfloat16 holds every integer up to 256: exact up to n = 128) in
whatever order the backend adds. The only inexact result is avg on floats at a world size
that is not a power of two (1/n is not a binary fraction): it is compared within 2 ulp,
nccl-tests' tolerance for avg.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.distributed as dist

OUT_OF_PLACE, IN_PLACE, LATENCY = "out-of-place", "in-place", "latency"
_MOVE_PERIOD, _REDUCE_PERIOD = 251, 5
_RANK_STRIDE = 17  # shifts each rank's pattern so that neighbouring ranks' data differ

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}

# torch 2.13 renamed the tensor forms; 2.11 (and older) only has the first names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Setting:
    """One measured point on one rank: who, how big, which type, op and root."""
    rank: int
    world: int
    count: int
    dtype: torch.dtype
    device: torch.device
    op: str = "sum"
    root: int = 0


@dataclass
class Case:
    """Ready-to-run buffers: `fill()` writes the inputs, `run()` issues one collective,
    `result` is this rank's output and `expected()` what it must hold (None: unchecked)."""
    run: Callable[[], object]
    fill: Callable[[], None]
    result: Optional[torch.Tensor]
    expected: Callable[[], Optional[torch.Tensor]]


def pattern(rank: int, numel: int, s: Setting, period: int, start: int = 0) -> torch.Tensor:
    """Rank `rank`'s input elements `start .. start + numel` (See Note [Exact data])."""
    idx = torch.arange(start, start + numel, dtype=torch.int32, device=s.device)
    return ((idx + _RANK_STRIDE * rank) % period - period // 2).to(s.dtype)


def reduced(s: Setting, numel: int, start: int = 0) -> torch.Tensor:
    """The exact reduction over all ranks of their patterns; float64 for avg."""
    acc = pattern(0, numel, s, _REDUCE_PERIOD, start).to(torch.int32)
    for r in range(1, s.world):
        term = pattern(r, numel, s, _REDUCE_PERIOD, start).to(torch.int32)
        acc = {"sum": torch.add, "avg": torch.add, "max": torch.maximum,
               "min": torch.minimum}[s.op](acc, term)
    return acc.double() / s.world if s.op == "avg" else acc.to(s.dtype)


def count_wrong(result: torch.Tensor, expected: torch.Tensor, s: Setting) -> int:
    if s.op == "avg" and result.is_floating_point():
        # 2 ulp, as nccl-tests: avg may be computed as a prescaled sum, inexact when 1/n is
        # not a binary fraction; eps x |x| bounds one ulp of x (>= 1 to cover results near 0).
        tol = 2 * torch.finfo(result.dtype).eps * expected.abs().clamp(min=1.0)
        return int(((result.double() - expected).abs() > tol).sum())
    return int((result != expected).sum())


class Collective:
    name: ClassVar[str]
    reduces: ClassVar[bool] = False      # takes -o
    rooted: ClassVar[bool] = False       # takes -r
    chunked: ClassVar[bool] = False      # the size is count x n (count per rank or peer)
    placements: ClassVar[tuple[str, ...]] = (IN_PLACE,)
    min_world: ClassVar[int] = 1
    moves_data: ClassVar[bool] = True    # False: a size-0 latency-only row

    @staticmethod
    def bus_factor(n: int) -> float:
        raise NotImplementedError

    @classmethod
    def count(cls, size: int, elt: int, n: int) -> int:
        """Elements per rank (the count column) for a `size`-byte measurement."""
        return size // elt // (n if cls.chunked else 1)

    @classmethod
    def bandwidths(cls, size: int, seconds: float, n: int) -> tuple[float, float]:
        """(algbw, busbw) in GB/s of a `size`-byte call that took `seconds`."""
        algbw = size / seconds / 1e9
        return algbw, algbw * cls.bus_factor(n)

    @classmethod
    def nbytes(cls, count: int, elt: int, n: int) -> int:
        """Bytes of the size column: nccl-tests' max(send, receive) bytes."""
        return count * elt * (n if cls.chunked else 1)

    def case(self, s: Setting, placement: str) -> Case:
        raise NotImplementedError


class AllReduce(Collective):
    name, reduces = "all_reduce", True

    @staticmethod
    def bus_factor(n: int) -> float:
        return 2 * (n - 1) / n

    def case(self, s: Setting, placement: str) -> Case:
        t = torch.empty(s.count, dtype=s.dtype, device=s.device)
        op = REDUCE_OPS[s.op]
        return Case(lambda: dist.all_reduce(t, op=op),
                    lambda: t.copy_(pattern(s.rank, s.count, s, _REDUCE_PERIOD)),
                    t, lambda: reduced(s, s.count))


class Broadcast(Collective):
    name, rooted = "broadcast", True

    @staticmethod
    def bus_factor(n: int) -> float:
        return 1.0

    def case(self, s: Setting, placement: str) -> Case:
        t = torch.empty(s.count, dtype=s.dtype, device=s.device)
        return Case(lambda: dist.broadcast(t, s.root),
                    lambda: t.copy_(pattern(s.rank, s.count, s, _MOVE_PERIOD)),
                    t, lambda: pattern(s.root, s.count, s, _MOVE_PERIOD))


class Reduce(Collective):
    name, reduces, rooted = "reduce", True, True

    @staticmethod
    def bus_factor(n: int) -> float:
        return 1.0

    def case(self, s: Setting, placement: str) -> Case:
        t = torch.empty(s.count, dtype=s.dtype, device=s.device)
        op = REDUCE_OPS[s.op]
        # Only the root's buffer is defined after a reduce.
        return Case(lambda: dist.reduce(t, s.root, op=op),
                    lambda: t.copy_(pattern(s.rank, s.count, s, _REDUCE_PERIOD)),
                    t, lambda: reduced(s, s.count) if s.rank == s.root else None)


class AllGather(Collective):
    name, chunked, placements = "all_gather", True, (OUT_OF_PLACE, IN_PLACE)

    @staticmethod
    def bus_factor(n: int) -> float:
        return (n - 1) / n

    def case(self, s: Setting, placement: str) -> Case:
        out = torch.empty(s.count * s.world, dtype=s.dtype, device=s.device)
        mine = s.rank * s.count
        inp = (out.narrow(0, mine, s.count) if placement == IN_PLACE
               else torch.empty(s.count, dtype=s.dtype, device=s.device))

        def expected() -> torch.Tensor:
            return torch.cat([pattern(r, s.count, s, _MOVE_PERIOD, r * s.count)
                              for r in range(s.world)])

        return Case(lambda: _all_gather(out, inp),
                    lambda: inp.copy_(pattern(s.rank, s.count, s, _MOVE_PERIOD, mine)),
                    out, expected)


class ReduceScatter(Collective):
    name, reduces, chunked = "reduce_scatter", True, True
    placements = (OUT_OF_PLACE, IN_PLACE)

    @staticmethod
    def bus_factor(n: int) -> float:
        return (n - 1) / n

    def case(self, s: Setting, placement: str) -> Case:
        inp = torch.empty(s.count * s.world, dtype=s.dtype, device=s.device)
        mine = s.rank * s.count
        out = (inp.narrow(0, mine, s.count) if placement == IN_PLACE
               else torch.empty(s.count, dtype=s.dtype, device=s.device))
        op = REDUCE_OPS[s.op]
        return Case(lambda: _reduce_scatter(out, inp, op=op),
                    lambda: inp.copy_(pattern(s.rank, inp.numel(), s, _REDUCE_PERIOD)),
                    out, lambda: reduced(s, s.count, mine))


class AllToAll(Collective):
    name, chunked, placements = "all_to_all", True, (OUT_OF_PLACE,)

    @staticmethod
    def bus_factor(n: int) -> float:
        return (n - 1) / n

    def case(self, s: Setting, placement: str) -> Case:
        inp = torch.empty(s.count * s.world, dtype=s.dtype, device=s.device)
        out = torch.empty_like(inp)

        def expected() -> torch.Tensor:
            # Chunk r of the output is chunk `rank` of rank r's input.
            return torch.cat([pattern(r, s.count, s, _MOVE_PERIOD, s.rank * s.count)
                              for r in range(s.world)])

        return Case(lambda: dist.all_to_all_single(out, inp),
                    lambda: inp.copy_(pattern(s.rank, inp.numel(), s, _MOVE_PERIOD)),
                    out, expected)


class SendRecv(Collective):
    """Every rank sends to rank + 1 and receives from rank - 1 (a ring), as nccl-tests."""
    name, placements, min_world = "sendrecv", (OUT_OF_PLACE,), 2

    @staticmethod
    def bus_factor(n: int) -> float:
        return 1.0

    def case(self, s: Setting, placement: str) -> Case:
        send = torch.empty(s.count, dtype=s.dtype, device=s.device)
        recv = torch.empty_like(send)
        prev, nxt = (s.rank - 1) % s.world, (s.rank + 1) % s.world

        def run() -> None:
            ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prev)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return Case(run, lambda: send.copy_(pattern(s.rank, s.count, s, _MOVE_PERIOD)),
                    recv, lambda: pattern(prev, s.count, s, _MOVE_PERIOD))


class Barrier(Collective):
    """Latency only: one row, no data, no bandwidth."""
    name, placements, moves_data = "barrier", (LATENCY,), False

    @staticmethod
    def bus_factor(n: int) -> float:
        return 0.0

    def case(self, s: Setting, placement: str) -> Case:
        return Case(dist.barrier, lambda: None, None, lambda: None)


COLLECTIVES: dict[str, Collective] = {c.name: c() for c in (
    AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, AllToAll, SendRecv, Barrier)}
