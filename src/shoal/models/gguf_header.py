"""How long a GGUF file's header is, from its first bytes alone (a pure function).

A worker that fetches parts of a remote GGUF (``hub_ranges``) needs the header (metadata and
the tensor table) before it knows where any tensor is, but not how long the header is: this
walks the header as far as the bytes given reach and says where the tensor data starts, or
that it needs more bytes. The layout is GGUF v2/v3 (``gguf-py``'s ``GGUFReader`` reads the
same): magic, version, tensor and key counts, the key/value pairs, the tensor infos, then
padding to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
_STRING, _ARRAY = 8, 9
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each fixed-size GGUF value type."""
_UINT32 = 4


class _Short(Exception):
    """The bytes end inside the header."""


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise _Short
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk

    def u32(self) -> int:
        value: int = struct.unpack("<I", self.take(4))[0]
        return value

    def u64(self) -> int:
        value: int = struct.unpack("<Q", self.take(8))[0]
        return value

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _FIXED:
                self.take(_FIXED[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _FIXED:
            self.take(_FIXED[kind])
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def data_offset(data: bytes) -> int | None:
    """Where the tensor data starts in a GGUF file beginning with ``data`` (the header's length
    with its padding), or None when ``data`` ends inside the header.

    Raises ``ValueError`` when ``data`` is not the start of a GGUF v2/v3 file.
    """
    if len(data) >= len(MAGIC) and data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic at its start)")
    cursor = _Cursor(data)
    try:
        cursor.take(len(MAGIC))
        version = cursor.u32()
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cursor.u64(), cursor.u64()
        alignment = DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = cursor.string()
            kind = cursor.u32()
            if key == ALIGNMENT_KEY.encode() and kind == _UINT32:
                alignment = cursor.u32()
            else:
                cursor.skip_value(kind)
        for _ in range(n_tensors):
            cursor.string()
            n_dims = cursor.u32()
            cursor.take(8 * n_dims + 4 + 8)  # dims, type, offset
    except _Short:
        return None
    if alignment <= 0:
        raise ValueError(f"GGUF alignment {alignment} is not positive")
    return -(-cursor.at // alignment) * alignment
