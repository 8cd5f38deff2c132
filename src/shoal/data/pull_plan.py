"""Which bytes of a GGUF file a worker needs to run layers ``first..last``: a pure function.

A worker holding a slice of a model needs the header (``[0, data_offset)``: metadata and the
tensor table, so the file parses), its layers' tensors, and:

- the input layer (``token_embd*``) when its slice starts at layer 0;
- the output layer (``output_norm*``, ``output.*``) when it ends at the last layer, and
  ``token_embd.weight`` too when the embeddings are tied (llama.cpp reuses it as the output);
- every tensor that belongs to no layer and is neither input nor output (``rope_freqs``, used
  by all layers), since it is small and any slice may need it.

Tensors of blocks past ``block_count`` (next-token-prediction layers) are never included.
Ranges are absolute ``[start, end)`` file offsets, sorted, and merged where they touch or
are separated only by alignment padding.
"""

from __future__ import annotations

from shoal.models.byte_ranges import ByteRange, merge_ranges
from shoal.models.gguf_info import GGUFInfo, TensorInfo

# How gguf_info classifies non-layer tensors.
_HEAD_PREFIX = "token_embd"
_TAIL_PREFIXES = ("output_norm", "output.")
_EMBEDDINGS = "token_embd.weight"


def layer_byte_ranges(info: GGUFInfo, first: int, last: int) -> tuple[ByteRange, ...]:
    """The merged byte ranges holding what layers ``first..last`` (inclusive) need.

    Raises ``ValueError`` (with a message for the user) for layers outside the model.
    """
    if not 0 <= first <= last < info.n_layers:
        raise ValueError(
            f"layers [{first}, {last}] are not a range within this model's layers "
            f"0..{info.n_layers - 1}; send [first, last] with first <= last (both inclusive)."
        )
    ranges: list[ByteRange] = [(0, info.data_offset)]
    ranges += [(layer.start, layer.end) for layer in info.layers[first : last + 1]]
    at_start, at_end = first == 0, last == info.n_layers - 1
    ranges += [
        (t.offset, t.offset + t.nbytes)
        for t in info.tensors
        if _needed(t, info, at_start=at_start, at_end=at_end)
    ]
    return merge_ranges(ranges, max_gap=info.alignment - 1)


def _needed(t: TensorInfo, info: GGUFInfo, *, at_start: bool, at_end: bool) -> bool:
    if t.layer is not None:
        return False  # layer tensors come in as whole layer ranges; extra blocks never
    if t.name.startswith(_HEAD_PREFIX):
        return at_start or (at_end and info.tied_embeddings and t.name == _EMBEDDINGS)
    if t.name.startswith(_TAIL_PREFIXES):
        return at_end
    return True
