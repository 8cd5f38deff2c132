"""A small llama-architecture GGUF whose weight tensors are over llama.cpp's RPC hash threshold.

The default model's tensors are all under 10 MiB, so llama.cpp never looks them up in a
stage's RPC cache. This one is made for the pre-seeding tests: 3 layers, ``n_embd`` 256 and
``n_ff`` 11264, so each FFN tensor is 11 MiB in F32 (over ``HASH_THRESHOLD``) while the
attention tensors (F16, 128 KiB each) stay far under it; the token embedding is Q8_0 and
tied (12.75 MiB: the last stage gets it again as the output weight, looked up by hash too).
Random weights from a fixed seed, the tokenizer and chat template copied from another GGUF
(the default model's), so llama-server runs it and its greedy answers are deterministic
noise. About 112 MiB; written once per version into a cache folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

VERSION = 1
N_LAYERS = 3
N_EMBD = 256
N_FF = 11264
N_HEAD = 4
N_HEAD_KV = 4
SEED = 1234


def big_tensor_gguf(folder: Path, tokenizer_from: Path) -> Path:
    """The test GGUF in ``folder`` (made if missing)."""
    path = folder / f"big-tensors-v{VERSION}.gguf"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        _write(part, tokenizer_from)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path


def _write(path: Path, tokenizer_from: Path) -> None:
    source = GGUFReader(tokenizer_from)
    n_vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    w = GGUFWriter(str(path), "llama")
    w.add_name("shoal-big-tensors-test")
    w.add_block_count(N_LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)  # ALL_F32 (mixed, as many models are)
    _copy_tokenizer(source, w)
    rng = np.random.default_rng(SEED)

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    embd = normal(n_vocab, N_EMBD, scale=0.5)
    w.add_tensor(
        "token_embd.weight",
        quantize(embd, GGMLQuantizationType.Q8_0),
        raw_dtype=GGMLQuantizationType.Q8_0,
    )
    kv = N_EMBD // N_HEAD * N_HEAD_KV
    for i in range(N_LAYERS):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"{b}.attn_q.weight", normal(N_EMBD, N_EMBD, scale=0.1).astype(np.float16))
        w.add_tensor(f"{b}.attn_k.weight", normal(kv, N_EMBD, scale=0.1).astype(np.float16))
        w.add_tensor(f"{b}.attn_v.weight", normal(kv, N_EMBD, scale=0.1).astype(np.float16))
        w.add_tensor(f"{b}.attn_output.weight", normal(N_EMBD, N_EMBD).astype(np.float16))
        w.add_tensor(f"{b}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_gate.weight", normal(N_FF, N_EMBD, scale=0.05))
        w.add_tensor(f"{b}.ffn_up.weight", normal(N_FF, N_EMBD, scale=0.05))
        w.add_tensor(f"{b}.ffn_down.weight", normal(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _copy_tokenizer(source: GGUFReader, w: GGUFWriter) -> None:
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype is GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
