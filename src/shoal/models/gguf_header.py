"""A GGUF file's header layout from its first bytes alone: how long the header is, and how long
the whole file must be to hold every tensor's data (pure functions); ``check_complete`` reads
only a file's header to say whether the file is cut short.

A worker that fetches parts of a remote GGUF (``hub_ranges``) needs the header (metadata and
the tensor table) before it knows where any tensor is, but not how long the header is: this
walks the header as far as the bytes given reach and says where the tensor data starts, or
that it needs more bytes. A worker about to start llama-server checks that the file holds
every tensor's extent (llama.cpp otherwise fails to load it, again at every restart). The
layout is GGUF v2/v3 (``gguf-py``'s ``GGUFReader`` reads the same): magic, version, tensor and
key counts, the key/value pairs, the tensor infos, then padding to ``general.alignment`` (32
by default).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from shoal.models.errors import ModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
HEADER_CHUNK = 1 << 20
"""Bytes read (or asked for by HTTP Range) at a time until the header ends (most headers are
1-10 MiB: the tokenizer's vocabulary)."""
MAX_HEADER = 256 << 20
"""A header is never longer; past this the file is not a GGUF Shoal can read."""
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


@dataclass(frozen=True)
class _Layout:
    data_offset: int
    """Where the tensor data starts (the header's length with its padding)."""
    data_end: int
    """The byte after the last tensor's data (with no tensors, the header's end, without the
    padding): the least size of a whole file."""


def data_offset(data: bytes) -> int | None:
    """Where the tensor data starts in a GGUF file beginning with ``data`` (the header's length
    with its padding), or None when ``data`` ends inside the header.

    Raises ``ValueError`` when ``data`` is not the start of a GGUF v2/v3 file.
    """
    layout = _layout(data)
    return layout.data_offset if layout else None


def next_header_read(data: bytes, size: int) -> int | tuple[int, int] | None:
    """One step of reading a header from its first bytes (``data``) of a ``size``-byte file:
    the header's length with its padding when ``data`` holds it all, else the byte range
    ``[start, end)`` to read next (``HEADER_CHUNK`` at a time), or None when the header does
    not end within the file or ``MAX_HEADER`` (not a GGUF Shoal can read).

    The loop every remote reader runs (Hugging Face ranges, a model store's), sync or async.
    Raises ``ValueError`` when ``data`` is not the start of a GGUF v2/v3 file.
    """
    end = data_offset(data)
    if end is not None:
        return end
    limit = min(size, MAX_HEADER)
    if len(data) >= limit:
        return None
    return len(data), min(limit, len(data) + HEADER_CHUNK)


def data_end(data: bytes) -> int | None:
    """How many bytes a GGUF file beginning with ``data`` must have to hold every tensor's
    data (the end of the tensor that ends last), or None when ``data`` ends inside the header.

    A tensor of a type this gguf-py does not know counts only where it starts. Raises
    ``ValueError`` when ``data`` is not the start of a GGUF v2/v3 file.
    """
    layout = _layout(data)
    return layout.data_end if layout else None


def check_complete(path: Path) -> None:
    """Raise ``ModelError`` when the GGUF file at ``path`` is shorter than its tensor table
    says (a download or copy cut short). Reads only the header. Blocking."""
    size = path.stat().st_size
    try:
        layout = _read_layout(path)
    except ValueError as exc:
        raise ModelError(f"{path} is not a GGUF model Shoal can use: {exc}.") from None
    if layout is None:
        raise ModelError(
            f"{path} is truncated: its {size} bytes end inside the GGUF header; delete it and "
            "pull again."
        )
    if size < layout.data_end:
        raise ModelError(
            f"{path} is truncated: {size} of {layout.data_end} bytes; delete it and pull again."
        )


def _read_layout(path: Path) -> _Layout | None:
    """The file's layout, or None when the file ends inside its header."""
    data = b""
    with path.open("rb") as f:
        while len(data) < MAX_HEADER:
            chunk = f.read(max(HEADER_CHUNK, len(data)))  # doubling: a long header is parsed
            data += chunk  # a few times, not once per MiB
            layout = _layout(data)
            if layout is not None or not chunk:
                return layout
    raise ValueError(f"its header is longer than {MAX_HEADER} bytes")


def _layout(data: bytes) -> _Layout | None:
    if len(data) >= len(MAGIC) and data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic at its start)")
    cursor = _Cursor(data)
    try:
        cursor.take(len(MAGIC))
        version = cursor.u32()
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cursor.u64(), cursor.u64()
        alignment = _skip_metadata(cursor, n_kv)
        extents = [_tensor_extent(cursor) for _ in range(n_tensors)]
    except _Short:
        return None
    if alignment <= 0:
        raise ValueError(f"GGUF alignment {alignment} is not positive")
    start = -(-cursor.at // alignment) * alignment
    return _Layout(start, start + max(extents) if extents else cursor.at)


def _skip_metadata(cursor: _Cursor, n_kv: int) -> int:
    """Walk past the key/value pairs; the alignment they give (or the default)."""
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cursor.string()
        kind = cursor.u32()
        if key == ALIGNMENT_KEY.encode() and kind == _UINT32:
            alignment = cursor.u32()
        else:
            cursor.skip_value(kind)
    return alignment


def _tensor_extent(cursor: _Cursor) -> int:
    """One tensor info: where its data ends, relative to the start of the tensor data."""
    cursor.string()  # name
    n_dims = cursor.u32()
    dims: tuple[int, ...] = struct.unpack(f"<{n_dims}Q", cursor.take(8 * n_dims))
    kind, offset = cursor.u32(), cursor.u64()
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):  # a type newer than this gguf-py: its start is all we know
        return offset
    return offset + math.prod(dims) // block * block_bytes
