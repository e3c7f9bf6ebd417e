"""Gloo's ring order of a sum, written out for tests that need the exact float bits of a
reduction the "pycomm" backend performs inside a larger one (Note [Gloo's summation order]
in csrc/shm/sum_order.h; tests/shm/test_gloo_order.py holds the backend to Gloo itself)."""

from __future__ import annotations

import torch

MAX_SEGMENT_BYTES = 1 << 20


def _up(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def chunk_elements(world: int, elem: int, total: int) -> int:
    """Elements of each rank's chunk in Gloo's ring all-reduce of `total` elements."""
    nbytes, cap = max(total, 1) * elem, elem * max(1, MAX_SEGMENT_BYTES // elem)
    segments = _up(max((nbytes + cap - 1) // cap, 2 * world), world)
    segment = _up((nbytes + segments - 1) // segments, elem)
    return segments // world * segment // elem


def ring_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the ranks' equally long buffers `terms` as Gloo's ring all-reduce adds
    them: chunk c's elements are ((x[c-1] + x[c-2]) + ...) + x[c], ranks mod W."""
    world, total = len(terms), terms[0].numel()
    per = chunk_elements(world, terms[0].element_size(), total)
    out = torch.empty_like(terms[0])
    for c in range(world):
        lo, hi = min(total, c * per), min(total, (c + 1) * per)
        order = [(c - 1 - k) % world for k in range(world - 1)] + [c]
        acc = terms[order[0]][lo:hi].clone()
        for r in order[1:]:
            acc += terms[r][lo:hi]
        out[lo:hi] = acc
    return out
