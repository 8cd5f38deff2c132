"""``shoal models inspect``'s text: a GGUF file's summary, memory estimate and layer table."""

from __future__ import annotations

from shoal.models.gguf_info import MIB, GGUFInfo, kv_bytes_per_token, memory_estimate


def describe(info: GGUFInfo, *, tensors: bool = False) -> str:
    """A readable multi-line summary; with ``tensors``, one line per tensor as well."""
    lines = _summary_lines(info) + _estimate_lines(info) + _layer_lines(info)
    if tensors:
        lines += _tensor_lines(info)
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def _summary_lines(info: GGUFInfo) -> list[str]:
    layer_bytes = sum(r.nbytes for r in info.layers)
    tied = " (tied embeddings: a copy of token_embd)" if info.tied_embeddings else ""
    return [
        f"{info.name or info.path.stem} ({info.architecture})",
        f"  file: {info.path}, {_mib(info.file_size)}, GGUF v{info.version}, "
        f"{len(info.tensors)} tensors, data at byte {info.data_offset}, "
        f"alignment {info.alignment}",
        f"  quantization: {info.quantization or 'unknown'}",
        f"  layers: {info.n_layers}, context: {info.context_length}, "
        f"embedding: {info.embedding_length}, feed-forward: {info.feed_forward_length}",
        f"  heads: {info.head_count} ({info.head_count_kv} KV), key/value length: "
        f"{info.key_length}/{info.value_length}, vocab: {info.vocab_size}",
        f"  weights: layers {_mib(layer_bytes)}, head {_mib(info.head_bytes)}, "
        f"tail {_mib(info.tail_bytes)}{tied}, other {_mib(info.other_bytes)}",
        f"  KV cache (f16): {kv_bytes_per_token(info, range(info.n_layers))} bytes per token",
    ]


def _estimate_lines(info: GGUFInfo) -> list[str]:
    lines = ["  memory estimate, whole model on one device (f16 KV):"]
    for ctx in dict.fromkeys((info.context_length, 4096)):
        e = memory_estimate(info, range(info.n_layers), ctx, with_head=True, with_tail=True)
        lines.append(
            f"    ctx {ctx:>6}: weights {_mib(e.weights_bytes)} + KV {_mib(e.kv_bytes)} "
            f"+ compute {_mib(e.compute_bytes)} = {_mib(e.total_bytes)}"
        )
    return lines


def _layer_lines(info: GGUFInfo) -> list[str]:
    lines = [f"  {'layer':>5}  {'start':>12}  {'end':>12}  {'size':>12}"]
    for r in info.layers:
        lines.append(f"  {r.layer:>5}  {r.start:>12}  {r.end:>12}  {_mib(r.nbytes):>12}")
    return lines


def _tensor_lines(info: GGUFInfo) -> list[str]:
    lines = [f"  {'tensor':<32}  {'type':<6}  {'shape':<16}  {'offset':>12}  {'bytes':>10}"]
    for t in info.tensors:
        shape = "x".join(str(n) for n in t.shape)
        lines.append(
            f"  {t.name:<32}  {t.ggml_type:<6}  {shape:<16}  {t.offset:>12}  {t.nbytes:>10}"
        )
    return lines
