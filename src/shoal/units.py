"""Byte units and how Shoal writes byte counts for people (binary units: KiB, MiB, GiB)."""

from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB

_UNITS = ((TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB"))


def format_bytes(n: int, *, digits: int = 1) -> str:
    """``n`` bytes in the largest binary unit it reaches, with ``digits`` decimals.

    >>> format_bytes(6_549_825_536)
    '6.1 GiB'
    >>> format_bytes(98_362_432)
    '93.8 MiB'
    >>> format_bytes(512)
    '512 B'
    """
    size = abs(n)
    sign = "-" if n < 0 else ""
    for factor, unit in _UNITS:
        if size >= factor:
            return f"{sign}{size / factor:.{digits}f} {unit}"
    return f"{sign}{size} B"
