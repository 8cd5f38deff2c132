"""GGUF structure: the real default model, tiny GGUFs written with ``gguf.GGUFWriter``, errors.

Facts about the default model are from ``reference/verified.md`` (read with ``GGUFReader``) and
from llama-server's own logs (buffer sizes for a single CPU and for a two-RPC-server split).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest

from shoal.models.errors import ModelError
from shoal.models.gguf_info import (
    MIB,
    GGUFInfo,
    inspect,
    kv_bytes_per_token,
    memory_estimate,
    to_json,
)
from shoal.models.gguf_report import describe
from shoal.models.resolve import resolve_model

Q8_0 = gguf.GGMLQuantizationType.Q8_0

# The tiny model: 2 blocks, n_embd 64, 4 heads (head dim 16), 2 KV heads, vocab 32.
N_EMBD = 64
N_FF = 128
N_VOCAB = 32
N_KV_EMBD = 32


@pytest.fixture(scope="module")
def smollm(cache_dir: Path) -> GGUFInfo:
    return inspect(resolve_model("smollm2-135m-instruct", cache_dir, download=False).path)


# The real default model


def test_default_model_hyperparameters(smollm: GGUFInfo) -> None:
    assert smollm.architecture == "llama"
    assert smollm.version == 3
    assert smollm.n_layers == 30
    assert smollm.embedding_length == 576
    assert smollm.feed_forward_length == 1536
    assert (smollm.head_count, smollm.head_count_kv) == (9, 3)
    assert (smollm.key_length, smollm.value_length) == (64, 64)
    assert smollm.context_length == 8192
    assert smollm.vocab_size == 49152
    assert smollm.quantization == "Q4_1"
    assert smollm.file_size == 98_362_432
    assert smollm.alignment == 32


def test_default_model_tensors(smollm: GGUFInfo) -> None:
    assert len(smollm.tensors) == 272
    by_name = {t.name: t for t in smollm.tensors}
    assert by_name["token_embd.weight"].ggml_type == "Q8_0"
    assert by_name["token_embd.weight"].shape == (576, 49152)
    assert by_name["output_norm.weight"].ggml_type == "F32"
    assert "output.weight" not in by_name
    assert smollm.tied_embeddings
    block = [t for t in smollm.tensors if t.layer is not None]
    assert len(block) == 30 * 9
    for t in block:
        assert t.ggml_type == ("F32" if t.name.endswith("norm.weight") else "Q4_1"), t.name
    assert by_name["blk.7.attn_k.weight"].shape == (576, 192)
    assert by_name["blk.7.attn_k.weight"].layer == 7


def test_default_model_byte_ranges(smollm: GGUFInfo) -> None:
    assert smollm.data_offset + sum(t.nbytes for t in smollm.tensors) <= smollm.file_size
    assert [r.layer for r in smollm.layers] == list(range(30))
    for r in smollm.layers:
        members = [t for t in smollm.tensors if t.layer == r.layer]
        assert r.nbytes == sum(t.nbytes for t in members)
        assert smollm.data_offset <= r.start < r.end <= smollm.file_size
        assert r.end - r.start >= r.nbytes
        assert all(r.start <= t.offset and t.offset + t.nbytes <= r.end for t in members)
    by_start = sorted(smollm.layers, key=lambda r: r.start)
    for before, after in zip(by_start, by_start[1:], strict=False):
        assert before.end <= after.start
    # The converter wrote the blocks in name order (blk.0, blk.1, blk.10, ...), so consecutive
    # layers are not consecutive in the file.
    assert [r.layer for r in by_start] == sorted(range(30), key=str)


def test_default_model_sizes(smollm: GGUFInfo) -> None:
    assert {r.nbytes for r in smollm.layers} == {2_216_448}
    assert smollm.head_bytes == 30_081_024
    # output_norm plus the duplicate of the tied token_embd.
    assert smollm.tail_bytes == 2_304 + 30_081_024
    assert smollm.other_bytes == 0
    assert smollm.tensor_bytes == smollm.file_size - smollm.data_offset


def test_default_model_memory_matches_llama_server_on_cpu(smollm: GGUFInfo) -> None:
    # llama-server -c 4096 / -c 8192 on CPU: "CPU_Mapped model buffer size = 92.10 MiB",
    # "KV buffer size = 90.00 MiB" / "180.00 MiB".
    everything = range(smollm.n_layers)
    for ctx, kv_mib in ((4096, 90), (8192, 180), (4000, 90)):
        e = memory_estimate(smollm, everything, ctx, with_head=True, with_tail=True)
        assert e.weights_bytes == smollm.tensor_bytes
        assert round(e.weights_bytes / MIB, 2) == 92.10
        assert e.kv_bytes == kv_mib * MIB
        assert e.compute_bytes >= 64 * MIB
        assert e.total_bytes == e.weights_bytes + e.kv_bytes + e.compute_bytes
    assert kv_bytes_per_token(smollm, everything) == 30 * (192 + 192) * 2


def test_default_model_memory_matches_the_verified_rpc_split(smollm: GGUFInfo) -> None:
    # llama-server --rpc A,B -ngl 99 -ts 1,2 -c 2048: model buffers 23.25 / 68.85 MiB and
    # KV buffers 16.5 / 28.5 MiB; token_embd stays on the host.
    first = memory_estimate(smollm, range(0, 11), 2048, with_head=False, with_tail=False)
    second = memory_estimate(smollm, range(11, 30), 2048, with_head=False, with_tail=True)
    assert round(first.weights_bytes / MIB, 2) == 23.25
    assert round(second.weights_bytes / MIB, 2) == 68.85
    assert first.kv_bytes == 16.5 * MIB
    assert second.kv_bytes == 28.5 * MIB


def test_layers_outside_the_model_are_refused(smollm: GGUFInfo) -> None:
    with pytest.raises(ValueError, match="outside"):
        kv_bytes_per_token(smollm, range(25, 31))
    with pytest.raises(ValueError, match="ctx"):
        memory_estimate(smollm, range(30), 0, with_head=True, with_tail=True)
    assert kv_bytes_per_token(smollm, range(0)) == 0


def test_default_model_json(smollm: GGUFInfo) -> None:
    data = to_json(smollm)
    assert json.loads(json.dumps(data)) == data
    assert data["path"] == str(smollm.path)
    assert data["architecture"] == "llama"
    metadata = data["metadata"]
    assert isinstance(metadata, dict)
    assert metadata["llama.block_count"] == 30
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert metadata["tokenizer.ggml.tokens"] == "array[49152] of string"
    assert metadata["tokenizer.ggml.merges"] == "array[48900] of string"
    assert "<|im_start|>" in str(metadata["tokenizer.chat_template"])
    tensors = data["tensors"]
    assert isinstance(tensors, list)
    assert tensors[0] == {
        "name": "token_embd.weight",
        "ggml_type": "Q8_0",
        "shape": [576, 49152],
        "offset": smollm.data_offset,
        "nbytes": 30_081_024,
        "layer": None,
    }


def test_default_model_description(smollm: GGUFInfo) -> None:
    text = describe(smollm)
    for expected in ("llama", "Q4_1", "layers: 30", "context: 8192", "9 (3 KV)", "tied"):
        assert expected in text
    assert "ctx   8192: weights 92.10 MiB + KV 180.00 MiB" in text
    assert "ctx   4096: weights 92.10 MiB + KV 90.00 MiB" in text
    assert sum(1 for line in text.splitlines() if line.endswith("2.11 MiB")) == 30
    assert "blk.29.attn_v.weight" not in text
    assert "blk.29.attn_v.weight" in describe(smollm, tensors=True)


# Tiny GGUFs written here


def _array(rng: np.random.Generator, *shape: int) -> npt.NDArray[np.float32]:
    return rng.standard_normal(shape).astype(np.float32)


def _tiny_tensors(n_blocks: int, output: bool) -> dict[str, npt.NDArray[np.float32]]:
    """Tensors in numpy order (the reverse of ggml's): rows first."""
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": _array(rng, N_VOCAB, N_EMBD)}
    for i in range(n_blocks):
        tensors |= {
            f"blk.{i}.attn_norm.weight": _array(rng, N_EMBD),
            f"blk.{i}.attn_q.weight": _array(rng, N_EMBD, N_EMBD),
            f"blk.{i}.attn_k.weight": _array(rng, N_KV_EMBD, N_EMBD),
            f"blk.{i}.attn_v.weight": _array(rng, N_KV_EMBD, N_EMBD),
            f"blk.{i}.attn_output.weight": _array(rng, N_EMBD, N_EMBD),
            f"blk.{i}.ffn_norm.weight": _array(rng, N_EMBD),
            f"blk.{i}.ffn_gate.weight": _array(rng, N_FF, N_EMBD),
            f"blk.{i}.ffn_up.weight": _array(rng, N_FF, N_EMBD),
            f"blk.{i}.ffn_down.weight": _array(rng, N_EMBD, N_FF),
        }
    tensors["output_norm.weight"] = _array(rng, N_EMBD)
    if output:
        tensors["output.weight"] = _array(rng, N_VOCAB, N_EMBD)
    return tensors


def write_tiny(
    path: Path,
    *,
    block_count: int = 2,
    n_blocks: int = 2,
    output: bool = True,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> dict[str, bytes]:
    """Write a tiny llama GGUF; ``output.weight`` is Q8_0, the rest F32. Returns tensor bytes."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_block_count(block_count)
    writer.add_context_length(256)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(N_VOCAB)])
    if extra is not None:
        extra(writer)
    written = {}
    for name, array in _tiny_tensors(n_blocks, output).items():
        if name == "output.weight":
            quantized = gguf.quants.quantize(array, Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=Q8_0)
            written[name] = quantized.tobytes()
        else:
            writer.add_tensor(name, array)
            written[name] = array.tobytes()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def test_tiny_model_structure(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    written = write_tiny(path)
    info = inspect(path)
    assert (info.architecture, info.name, info.n_layers) == ("llama", "tiny", 2)
    assert (info.embedding_length, info.head_count, info.head_count_kv) == (N_EMBD, 4, 2)
    assert (info.key_length, info.value_length, info.vocab_size) == (16, 16, N_VOCAB)
    assert info.quantization == "F32"
    assert not info.tied_embeddings
    assert [t.name for t in info.tensors] == list(written)
    by_name = {t.name: t for t in info.tensors}
    assert by_name["token_embd.weight"].shape == (N_EMBD, N_VOCAB)
    assert by_name["blk.1.ffn_down.weight"].shape == (N_FF, N_EMBD)
    assert by_name["output.weight"].ggml_type == "Q8_0"
    assert by_name["output.weight"].nbytes == N_VOCAB * N_EMBD // 32 * 34
    assert info.head_bytes == N_VOCAB * N_EMBD * 4
    assert info.tail_bytes == N_EMBD * 4 + N_VOCAB * N_EMBD // 32 * 34
    layer_bytes = (2 * N_EMBD + 2 * N_EMBD * N_EMBD + 2 * N_KV_EMBD * N_EMBD) * 4
    layer_bytes += 3 * N_FF * N_EMBD * 4
    assert [(r.layer, r.nbytes) for r in info.layers] == [(0, layer_bytes), (1, layer_bytes)]
    assert info.layers[0].end <= info.layers[1].start
    # Every offset is absolute: the file holds exactly what was written there.
    data = path.read_bytes()
    for t in info.tensors:
        assert (t.offset - info.data_offset) % info.alignment == 0
        assert data[t.offset : t.offset + t.nbytes] == written[t.name], t.name
    assert info.data_offset + info.tensor_bytes <= info.file_size == len(data)


def test_tiny_model_agrees_with_the_stock_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    info = inspect(path)
    reader = gguf.GGUFReader(path)
    assert info.data_offset == reader.data_offset
    assert [(t.name, t.offset, t.nbytes) for t in info.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in reader.tensors
    ]
    scalars = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY
    }
    assert {k: v for k, v in info.metadata.items() if k in scalars} == scalars
    assert info.metadata["tokenizer.ggml.tokens"] == f"array[{N_VOCAB}] of string"


def test_tiny_model_with_tied_embeddings(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    write_tiny(path, output=False)
    info = inspect(path)
    assert info.tied_embeddings
    assert info.tail_bytes == N_EMBD * 4 + info.head_bytes
    both = memory_estimate(info, range(2), 1, with_head=True, with_tail=True)
    assert both.weights_bytes == info.tensor_bytes
    # 2 layers x 2 KV heads x (16 + 16) x 2 bytes per token, 1 cell padded to 256.
    assert both.kv_bytes == 2 * 2 * 32 * 2 * 256
    tail_only = memory_estimate(info, range(1, 2), 1, with_head=False, with_tail=True)
    assert tail_only.weights_bytes == info.layers[1].nbytes + info.tail_bytes


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    written = write_tiny(path, extra=lambda w: w.add_custom_alignment(256))
    info = inspect(path)
    assert info.alignment == 256
    assert info.data_offset % 256 == 0
    data = path.read_bytes()
    for t in info.tensors:
        assert t.offset % 256 == 0
        assert data[t.offset : t.offset + t.nbytes] == written[t.name]


# Errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        inspect(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 this is a zip, not a model"])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError, match="not a GGUF file"):
        inspect(path)


@pytest.mark.parametrize("keep", [24, 300])
def test_truncated_header(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "cut.gguf"
    write_tiny(path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ModelError, match="cannot parse the GGUF header.*truncated or corrupt"):
        inspect(path)


def test_truncated_tensor_data(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    write_tiny(path)
    data_offset = inspect(path).data_offset
    path.write_bytes(path.read_bytes()[: data_offset + 100])
    with pytest.raises(ModelError, match="truncated or corrupt"):
        inspect(path)


def test_missing_block(tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    write_tiny(path, block_count=3)
    with pytest.raises(ModelError, match=r"block_count is 3 but block 2 has no tensors"):
        inspect(path)


def test_split_model_is_refused(tmp_path: Path) -> None:
    def shard(writer: gguf.GGUFWriter) -> None:
        writer.add_uint16("split.no", 0)
        writer.add_uint16("split.count", 3)

    path = tmp_path / "big-00001-of-00003.gguf"
    write_tiny(path, extra=shard)
    with pytest.raises(ModelError, match=r"shard 1 of a model split into 3 files.*--merge"):
        inspect(path)


def test_gguf_without_model_hyperparameters(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="not a GGUF model Shoal can use: llama.block_count"):
        inspect(path)
