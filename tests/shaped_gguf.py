"""GGUF files with a real header and a 7B-like shape but no tensors: what a fit reads of a
model on the Hub (its size from the listing, its shape from the header), at a few MiB."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf

N_LAYERS, N_HEADS, N_KV_HEADS, N_EMBD = 32, 32, 8, 4096
KV_BYTES_PER_TOKEN = N_LAYERS * 2 * N_KV_HEADS * (N_EMBD // N_HEADS) * 2
"""128 KiB: 32 layers x (K + V) x 8 KV heads x 128 x 2 bytes (f16)."""


def shaped_gguf(pad: int, *, split: tuple[int, int] | None = None) -> bytes:
    """The header, then ``pad`` zero bytes; ``split`` is (split.no, split.count)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_block_count(N_LAYERS)
        writer.add_context_length(32768)
        writer.add_embedding_length(N_EMBD)
        writer.add_head_count(N_HEADS)
        writer.add_head_count_kv(N_KV_HEADS)
        if split is not None:
            writer.add_uint16("split.no", split[0])
            writer.add_uint16("split.count", split[1])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes() + bytes(pad)
