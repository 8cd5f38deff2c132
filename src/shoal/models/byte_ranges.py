"""Byte ranges of a file, merged and counted (pure): what a partial download or a pull asks for.

Used by ``hub_ranges`` (a split model's stage fetching its layers from the Hub) and by the
model store's pull plan (``data/pull_plan.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

ByteRange = tuple[int, int]
"""``[start, end)``: absolute file offsets, end exclusive."""


def merge_ranges(ranges: Iterable[ByteRange], *, max_gap: int = 0) -> tuple[ByteRange, ...]:
    """Sort ranges and merge those that overlap, touch, or are at most ``max_gap`` apart."""
    merged: list[ByteRange] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)


def total_bytes(ranges: Iterable[ByteRange]) -> int:
    return sum(end - start for start, end in ranges)
