"""Which of a model's tensors a stage of a split model receives by hash (a pure function).

llama.cpp uploads to a stage (an RPC device) the tensors of its layers, and on the last one
the output layer; each over ``HASH_THRESHOLD`` it first asks for by hash, so a stage that has
them in its ``ggml-rpc-server`` cache gets none of their bytes (``llama_cpp.rpc_cache``). The
worker pre-seeds exactly these; the router's plan shows how many bytes that keeps off the wire.
"""

from __future__ import annotations

from shoal.llama_cpp.rpc_cache import hashed
from shoal.models.gguf_info import GGUFInfo, TensorInfo

_TAIL_PREFIXES = ("output_norm", "output.")
_EMBEDDINGS = "token_embd.weight"


def stage_tensors(info: GGUFInfo, first: int, last: int, output: bool) -> tuple[TensorInfo, ...]:
    """The tensors llama.cpp uploads to a stage holding layers ``first..last`` (and the output
    layer when ``output``) that it looks up by hash (over 10 MiB), in file order.

    With tied embeddings llama.cpp loads ``token_embd.weight`` again as the output weight on
    the output device, from the same bytes.
    """
    chosen = []
    for t in info.tensors:
        if t.layer is not None:
            wanted = first <= t.layer <= last
        elif t.name.startswith(_TAIL_PREFIXES):
            wanted = output
        else:
            wanted = output and info.tied_embeddings and t.name == _EMBEDDINGS
        if wanted and hashed(t.nbytes):
            chosen.append(t)
    return tuple(sorted(chosen, key=lambda t: t.offset))
