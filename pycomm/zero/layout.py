"""Which elements of the model each rank owns: the shard layout of
pycomm.ZeroRedundancyOptimizer. Pure arithmetic over bucket layouts; no process group.

Note [Flat shards of a bucket]
Each bucket (the reducer's, or one of ours when no pycomm DDP reduces the gradients) is a
flat run of N elements: its parameters back to back in slot order. With W ranks it is cut
in W equal ranges of S = N // W elements and a tail (split: Note [Equal ranges and a tail]
in csrc/comm/shard_split.h, the rule the pieces reduce-scatter cuts by too): rank r owns
[r*S, (r+1)*S), which the bucket's
reduce-scatter leaves reduced on it and whose updated values its all-gather sends to every
rank. The last N - W*S (< W) elements, the tail, belong to the last rank
(BucketShard.tail_owner). So every element has exactly one owner, which steps it, holds its
state and sends its update to every rank (the tails are broadcast from it after the step, a
few bytes). Without a DDP each rank's gradient may differ (torch's ZeroRedundancyOptimizer
lets each rank step what it owns with its own gradient): one owner per element is what
keeps the replicas equal then. Equal ranges are what the
tensor forms of reduce-scatter and all-gather need, on the bucket buffers themselves, with
no padding copy. A parameter may span ranges (Megatron's distributed optimizer cuts the same
way; torch's ZeroRedundancyOptimizer gives each rank whole parameters instead, which
balances worse and cannot reduce-scatter a bucket in one collective); a rank steps a
*piece* of it, a 1-D run of its elements. That is exact for an elementwise optimizer (SGD,
Adam, AdamW, Adagrad, RMSprop...: every element's update reads only that element's state);
one whose update reads the whole tensor (a norm, a matrix) is refused by name
(optimizer.py's ELEMENTWISE).

Note [Stepping in cache-sized blocks]
An optimizer stepping one tensor at a time (torch's for-loop form, the default on CPU)
runs each of its elementwise operations over the whole tensor before the next: AdamW
makes about nine passes over a piece of millions of elements, each from memory. Cut into
blocks of STEP_BLOCK elements (64 Ki: a block's parameter, gradient, two moments and
temporaries are a few MB, which the caches hold), all nine run on one block before the
next, and mostly only the first pass of each block reaches memory. Measured on this
project's CPU (one thread, AdamW over 12.6M elements, the same bits every way: an
element's arithmetic does not depend on where its tensor starts or ends, as for any
piece):
- one piece of 12.6M: 86.8 ms whole, 38.9 ms in 64 Ki blocks (16 Ki: 50.1 ms, lost again
  to the per-tensor overhead; 128 Ki: 39.5 ms; 256 Ki: 44.3 ms);
- the bench MLP's shard at 2 ranks, 8 pieces of about 1.6M: 48 ms against 39 ms; inside
  the bench's step, with the other rank stepping beside it, 66-68 ms against 57-59 ms.
So the gain grows with the pieces: about a tenth of the bench MLP's optimizer step, half
of it for a parameter of tens of millions. A block is a piece like any other: the state
dicts and re-cuts see runs of a parameter, whatever their length. Where the optimizer
steps lists of tensors per operation (foreach, fused, and torch's default on GPUs)
blocks gain nothing and are not cut (optimizer.py decides); nor where torch's Adam or
AdamW is stepped in one pass (pycomm/adam_step.py), whose kernel cuts its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _C

STEP_BLOCK = 1 << 16  # elements (See Note [Stepping in cache-sized blocks])


def split(n: int, world: int) -> tuple[int, int]:
    """(S, tail): n elements cut over `world` ranks (See Note [Equal ranges and a tail] in
    csrc/comm/shard_split.h, which owns the rule)."""
    return _C.shard_split(n, world)


@dataclass(frozen=True)
class Ranges:
    """Where `rank`'s elements are in a flat run of `numel` cut over `world` ranks: its
    range `mine`, the `tail` (the last rank's), as slices of the run; `shard` (S)
    elements in every rank's range. The one place slices of a bucket come from."""
    numel: int
    world: int
    rank: int
    shard: int
    tail_numel: int

    @classmethod
    def of(cls, numel: int, world: int, rank: int) -> Ranges:
        return cls(numel, world, rank, *split(numel, world))

    @property
    def mine(self) -> slice:
        return slice(self.rank * self.shard, (self.rank + 1) * self.shard)

    @property
    def ranges(self) -> slice:
        """Every rank's range, back to back (what a reduce-scatter or all-gather moves)."""
        return slice(0, self.world * self.shard)

    @property
    def tail(self) -> slice:
        return slice(self.world * self.shard, self.numel)

    @property
    def kept(self) -> int:
        """Elements a rank keeps of the run with released gradients: its range, then the
        tail (hook.py's HookState.grads); kept_mine and kept_tail slice them."""
        return self.shard + self.tail_numel

    @property
    def kept_mine(self) -> slice:
        return slice(0, self.shard)

    @property
    def kept_tail(self) -> slice:
        return slice(self.shard, self.kept)

    def kept_offset(self, element: int) -> int:
        """Where element `element` of the run (in this rank's range or the tail) sits in
        what the rank keeps."""
        tail = self.tail.start
        return element - self.mine.start if element < tail else self.shard + element - tail


@dataclass(frozen=True)
class Piece:
    """A run of one parameter's elements that one rank steps: param elements [lo, hi),
    bucket elements [flat, flat + hi - lo)."""
    param: int
    lo: int
    hi: int
    flat: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass
class BucketShard:
    """One bucket cut for `world` ranks (See Note [Flat shards of a bucket])."""
    index: int
    params: list[int]  # parameter indices, slot order
    offsets: list[int]  # per slot, in elements
    lengths: list[int]
    numel: int
    world: int
    rank: int
    pieces: list[Piece] = field(default_factory=list)  # this rank's: range (then the tail)
    ranges: Ranges = field(init=False)

    def __post_init__(self) -> None:
        self.ranges = Ranges.of(self.numel, self.world, self.rank)

    @property
    def shard(self) -> int:
        """S: elements of each rank's range."""
        return self.ranges.shard

    @property
    def tail_numel(self) -> int:
        return self.ranges.tail_numel

    @property
    def kept(self) -> int:
        """Elements of the gradients a rank keeps with released gradients (Ranges.kept)."""
        return self.ranges.kept

    @property
    def mine(self) -> tuple[int, int]:
        return self.ranges.mine.start, self.ranges.mine.stop

    @property
    def tail(self) -> tuple[int, int]:
        return self.ranges.tail.start, self.ranges.tail.stop

    @property
    def tail_owner(self) -> int:
        return self.world - 1

    def owner(self, element: int) -> int:
        """The rank that steps bucket element `element` (the tail's: tail_owner)."""
        return self.tail_owner if element >= self.world * self.shard else element // self.shard


def cut_bucket(index: int, params: list[int], lengths: list[int], world: int,
               rank: int, block: int = 0) -> BucketShard:
    """Bucket `index` cut for `world` ranks; this rank's pieces at most `block` elements
    long (0: as long as the parameter's run in the range)."""
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += n
    bucket = BucketShard(index, list(params), offsets, list(lengths), at, world, rank)
    runs = [bucket.mine] + ([bucket.tail] if rank == bucket.tail_owner else [])
    for lo, hi in runs:
        for p, off, n in zip(params, offsets, lengths):
            a, b = max(lo, off), min(hi, off + n)
            step = block or max(b - a, 1)
            for start in range(a, b, step):
                end = min(start + step, b)
                bucket.pieces.append(Piece(p, start - off, end - off, start))
    return bucket


def cut(buckets: list[list[int]], params: list[torch.Tensor], world: int,
        rank: int, block: int = 0) -> list[BucketShard]:
    """Every bucket of `buckets` (lists of indices into `params`) cut for `world` ranks,
    pieces at most `block` elements long (0: unblocked)."""
    return [cut_bucket(i, b, [params[p].numel() for p in b], world, rank, block)
            for i, b in enumerate(buckets)]


def signature(buckets: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(b) for b in buckets)
