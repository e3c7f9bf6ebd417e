"""Message sizes for pycomm-bench: parsing `8`, `64K`, `128M`, `1G` (binary multiples, as
nccl-tests) and the sweep between `-b` and `-e` by a factor (`-f`) or an increment (`-i`)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"(\d+)([KMG]?)(?:I?B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`'128M'` -> 134217728. Raises ValueError on anything that is not a size."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size (a whole number of bytes, optionally with "
                         f"K, M or G, as 8, 64K, 128M, 1G)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def sweep(min_bytes: int, max_bytes: int, factor: int = 0, increment: int = 0) -> list[int]:
    """Sizes from `min_bytes` to `max_bytes` inclusive: multiplied by `factor` when it is
    > 1, else increased by `increment` (exactly one of the two is set)."""
    if (factor > 1) == (increment > 0):
        raise ValueError("exactly one of factor (> 1) and increment (> 0) must be given")
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = size * factor if factor > 1 else size + increment
    return sizes


def format_size(nbytes: int) -> str:
    """The shortest exact spelling: 134217728 -> '128M', 1000 -> '1000'."""
    for unit in ("G", "M", "K"):
        if nbytes and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)
