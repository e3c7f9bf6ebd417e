"""Which elements of the model each rank owns: the shard layout of
pycomm.ZeroRedundancyOptimizer. Pure arithmetic over bucket layouts; no process group.

Note [Flat shards of a bucket]
Each bucket (the reducer's, or one of ours when no pycomm DDP reduces the gradients) is a
flat run of N elements: its parameters back to back in slot order. With W ranks it is cut
in W equal ranges of S = N // W elements: rank r owns [r*S, (r+1)*S), which the bucket's
reduce-scatter leaves reduced on it and whose updated values its all-gather sends to every
rank. The last N - W*S (< W) elements, the tail, belong to every rank: their gradients are
all-reduced (a few bytes) and every rank steps them, identically. Equal ranges are what the
tensor forms of reduce-scatter and all-gather need, on the bucket buffers themselves, with
no padding copy. A parameter may span ranges (Megatron's distributed optimizer cuts the same
way; torch's ZeroRedundancyOptimizer gives each rank whole parameters instead, which
balances worse and cannot reduce-scatter a bucket in one collective); a rank steps a
*piece* of it, a 1-D run of its elements. That is exact for an elementwise optimizer (SGD,
Adam, AdamW, Adagrad, RMSprop...: every element's update reads only that element's state);
one whose update reads the whole tensor (a norm, a matrix) is refused by name
(optimizer.py's ELEMENTWISE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    pieces: list[Piece] = field(default_factory=list)  # this rank's, range then tail

    @property
    def shard(self) -> int:
        """S: elements of each rank's range."""
        return self.numel // self.world

    @property
    def mine(self) -> tuple[int, int]:
        return self.rank * self.shard, (self.rank + 1) * self.shard

    @property
    def tail(self) -> tuple[int, int]:
        return self.world * self.shard, self.numel

    def owner(self, element: int) -> int:
        """The rank whose range holds bucket element `element` (-1: the tail)."""
        return -1 if element >= self.world * self.shard else element // self.shard


def cut_bucket(index: int, params: list[int], lengths: list[int], world: int,
               rank: int) -> BucketShard:
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += n
    bucket = BucketShard(index, list(params), offsets, list(lengths), at, world, rank)
    for lo, hi in (bucket.mine, bucket.tail):
        for p, off, n in zip(params, offsets, lengths):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                bucket.pieces.append(Piece(p, a - off, b - off, a))
    return bucket


def cut(buckets: list[list[int]], params: list[torch.Tensor], world: int,
        rank: int) -> list[BucketShard]:
    """Every bucket of `buckets` (lists of indices into `params`) cut for `world` ranks."""
    return [cut_bucket(i, b, [params[p].numel() for p in b], world, rank)
            for i, b in enumerate(buckets)]


def signature(buckets: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(b) for b in buckets)
