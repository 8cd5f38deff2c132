"""The structure of a GGUF file: metadata, tensors, per-layer byte ranges and memory needs.

Only the header is parsed (with ``gguf.GGUFReader`` over a memory map); tensor data is never
read, so inspecting a model costs well under a second however large it is.

Split GGUFs (``-00001-of-0000N.gguf``) are refused: their tensors live in several files, so
one set of absolute offsets cannot describe them. The error names the shard count and says how
to merge the shards (``llama-gguf-split --merge``) into a single file that can be inspected.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType, LlamaFileType
from gguf.gguf_reader import ReaderField, ReaderTensor

from shoal.models.errors import ModelError

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
MIB = 1024 * 1024
KV_CTX_PAD = 256
"""llama.cpp rounds the KV cache size up to a multiple of this many cells."""
COMPUTE_FLOOR_BYTES = 64 * MIB
"""Fixed part of the compute-buffer estimate (see :func:`memory_estimate`)."""
COMPUTE_MARGIN = 0.10
"""Compute buffers as a fraction of weights + KV (plus the floor above)."""

_LAYER_PREFIX = re.compile(r"^blk\.(\d+)\.")
_HEAD_PREFIX = "token_embd"
_TAIL_PREFIXES = ("output_norm", "output.")
_EMBEDDINGS = "token_embd.weight"
_OUTPUT = "output.weight"
_INT_TYPES = frozenset(t for t in GGUFValueType if t.name.startswith(("UINT", "INT")))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its ggml type, shape in ggml order (``ne0`` first) and where its data is."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    offset: int
    """Absolute file offset of the tensor's data."""
    nbytes: int
    layer: int | None
    """N for ``blk.N.*`` tensors, None for the others."""


@dataclass(frozen=True)
class LayerRange:
    """One repeating block: the byte range ``[start, end)`` its tensors' data spans, and size."""

    layer: int
    start: int
    end: int
    nbytes: int
    """Sum of the layer's tensor sizes (``end - start`` also counts alignment padding)."""


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file holds, without its tensor data.

    ``head_bytes`` is the input layer (``token_embd*``). Note that llama.cpp keeps the input
    layer in host memory (the llama-server process), not on the first GPU or RPC device: the
    verified two-RPC-server split of the default model (23.25 / 68.85 MiB) is 11 and 19 layers,
    the second plus ``tail_bytes``, with no ``token_embd`` on either device.

    ``tail_bytes`` is the output layer (``output_norm*``, ``output.*``). When ``output.weight``
    is absent the embeddings are tied (``tied_embeddings``) and llama.cpp loads a duplicate of
    ``token_embd.weight`` on the output device, so its size is counted in ``tail_bytes`` too.

    ``other_bytes`` are non-layer tensors that are neither head nor tail (e.g. ``rope_freqs``),
    plus ``blk.N`` tensors with N >= ``n_layers`` (e.g. next-token-prediction layers).
    """

    path: Path
    file_size: int
    version: int
    architecture: str
    name: str | None
    n_layers: int
    context_length: int
    embedding_length: int
    feed_forward_length: int | None
    head_count: int
    head_count_kv: int
    """Both head counts are the largest value when the file gives one value per layer."""
    key_length: int
    value_length: int
    vocab_size: int | None
    file_type: int | None
    quantization: str | None
    """``general.file_type`` as a label such as ``Q4_1`` or ``Q4_K_M``."""
    alignment: int
    data_offset: int
    metadata: dict[str, object] = field(repr=False, hash=False)
    """Every key/value pair; arrays are summarised (``"array[49152] of string"``)."""
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    layers: tuple[LayerRange, ...] = field(repr=False)
    head_bytes: int
    tail_bytes: int
    other_bytes: int
    tied_embeddings: bool

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all tensor data in the file (without alignment padding)."""
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device needs for some layers of a model at a context size."""

    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    total_bytes: int


def kv_cells(ctx: int) -> int:
    """The KV cells llama-server allocates for ``-c ctx`` (it pads to a multiple of 256)."""
    return math.ceil(ctx / KV_CTX_PAD) * KV_CTX_PAD


def with_compute(weights: int, kv: int, compute_margin: float = COMPUTE_MARGIN) -> MemoryEstimate:
    """What ``weights`` and a KV cache of ``kv`` bytes need, with compute buffers: the
    conservative rule of thumb ``compute_margin`` × (weights + KV) plus a 64 MiB floor
    (``memory_estimate`` says why)."""
    compute = math.ceil(compute_margin * (weights + kv)) + COMPUTE_FLOOR_BYTES
    return MemoryEstimate(
        weights_bytes=weights,
        kv_bytes=kv,
        compute_bytes=compute,
        total_bytes=weights + kv + compute,
    )


class _Reader(GGUFReader):
    """``GGUFReader`` that slices a plain ndarray view of its memory map.

    The stock reader slices the ``np.memmap`` itself for every value it parses; for the ~100k
    tokenizer strings of a small model the memmap subclass bookkeeping makes that about three
    times slower (2.7 s instead of 0.8 s here). The view maps the same bytes; nothing is read.
    """

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: None | Literal["I", "S", "<"] = None,
    ) -> npt.NDArray[Any]:
        if isinstance(self.data, np.memmap):
            # The reader only slices ``data``; a plain view of the same map serves it as well.
            self.data = self.data.view(np.ndarray)  # type: ignore[assignment]
        return super()._get(offset, dtype, count, override_order)


def inspect(path: Path) -> GGUFInfo:
    """Read the structure of the GGUF file at ``path``.

    Raises :class:`ModelError` when the file is missing, is not GGUF, is one shard of a split
    model, or its header cannot be parsed (truncated or corrupt).
    """
    path = Path(path)
    started = time.perf_counter()
    check_magic(path)
    try:
        reader = _Reader(path)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ModelError(
            f"cannot parse the GGUF header of {path} ({exc}): the file is probably truncated "
            "or corrupt; download or convert it again."
        ) from exc
    try:
        _refuse_split(path, reader)
        info = _build_info(path, reader)
    except ValueError as exc:
        raise ModelError(f"{path} is not a GGUF model Shoal can use: {exc}.") from exc
    elapsed = time.perf_counter() - started
    logger.debug("inspected %s (%s) in %.2f s", path, info.architecture, elapsed)
    return info


def inspect_cached(path: Path) -> GGUFInfo:
    """``inspect(path)``, read again only when the file changes (its mtime or size). Blocking."""
    stat = path.stat()
    return _inspect_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _inspect_cached(path: Path, mtime_ns: int, size: int) -> GGUFInfo:
    return inspect(path)


@dataclass(frozen=True)
class ModelShape:
    """What a KV-cache estimate needs (``fit.estimate_from_catalog``), from metadata alone."""

    architecture: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    """The mean of the key and value lengths, so ``2 * n_kv_heads * head_dim`` per layer."""
    context_length: int


def read_shape(path: Path) -> ModelShape:
    """The shape of the model whose GGUF header is at ``path``: a whole file, the first part of
    a split GGUF, or a header alone in a sparse file (the tensor data is never read)."""
    check_magic(path)
    try:
        reader = _Reader(path)
        arch = _str_value(reader, "general.architecture") or ""
        heads = _int_value(reader, f"{arch}.attention.head_count") or 0
        head_dim = _required_int(reader, f"{arch}.embedding_length") // heads if heads else 0
        keys = _int_value(reader, f"{arch}.attention.key_length") or head_dim
        values = _int_value(reader, f"{arch}.attention.value_length") or head_dim
        return ModelShape(
            architecture=arch,
            n_layers=_required_int(reader, f"{arch}.block_count"),
            n_kv_heads=_int_value(reader, f"{arch}.attention.head_count_kv") or heads,
            head_dim=-(-(keys + values) // 2),
            context_length=_int_value(reader, f"{arch}.context_length") or 0,
        )
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ModelError(
            f"cannot read the model's shape from the GGUF header {path}: {exc}"
        ) from exc


def kv_bytes_per_token(info: GGUFInfo, layers: range, cache_type_bytes: float = 2.0) -> int:
    """Bytes of KV cache one token needs in ``layers``: Σ (n_embd_k_gqa + n_embd_v_gqa) · bytes.

    ``cache_type_bytes`` is bytes per element: 2 for f16 (llama.cpp's default), 34/32 for q8_0.
    """
    return math.ceil(_kv_elements_per_token(info, layers) * cache_type_bytes)


def memory_estimate(
    info: GGUFInfo,
    layers: range,
    ctx: int,
    *,
    with_head: bool,
    with_tail: bool,
    compute_margin: float = COMPUTE_MARGIN,
    cache_type_bytes: float = 2.0,
) -> MemoryEstimate:
    """Estimate what one device needs to hold ``layers`` (plus head/tail) at context ``ctx``.

    - weights: the layers' tensor bytes, plus ``head_bytes`` / ``tail_bytes`` when asked. With
      tied embeddings on a device that has both, ``token_embd`` is counted once (on CPU,
      llama.cpp's mapped model buffer for the default model is exactly the file's tensor bytes).
    - KV: ``kv_bytes_per_token`` × ctx rounded up to a multiple of 256, as llama.cpp allocates
      it (``src/llama-kv-cache.cpp``). Sliding-window layers are counted at full size.
    - compute: not derivable from the file (it depends on the graph, ``n_ubatch``, flash
      attention and the backend; reference §4 gives 100 MiB–2 GiB on GPUs). This is a
      deliberately conservative rule of thumb: ``compute_margin`` × (weights + KV) plus a
      64 MiB floor (reference §4: "weights + KV + compute + ~5–10 % margin"). For comparison,
      llama-server on CPU reported 18.6 MiB (ctx 4096) and 22.6 MiB (ctx 8192) for the default
      model, where this gives about 82 and 91 MiB.
    """
    if ctx <= 0:
        raise ValueError(f"ctx must be positive, got {ctx}")
    weights = sum(info.layers[i].nbytes for i in _checked(info, layers))
    if with_head:
        weights += info.head_bytes
    if with_tail:
        weights += info.tail_bytes
    if with_head and with_tail and info.tied_embeddings:
        weights -= sum(t.nbytes for t in info.tensors if t.name == _EMBEDDINGS)
    kv = math.ceil(_kv_elements_per_token(info, layers) * cache_type_bytes * kv_cells(ctx))
    return with_compute(weights, kv, compute_margin)


def to_json(info: GGUFInfo) -> dict[str, object]:
    """``info`` as plain JSON-able values (paths as strings, tuples as lists)."""
    return {f.name: _jsonable(getattr(info, f.name)) for f in fields(info)}


# Reading


def check_magic(path: Path) -> None:
    """Raise ``ModelError`` unless ``path`` is a file that starts with the GGUF magic."""
    if not path.is_file():
        raise ModelError(f"GGUF file {path} does not exist (or is not a file).")
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}). "
            "llama.cpp loads only GGUF models; convert it with llama.cpp's convert scripts."
        )


def _refuse_split(path: Path, reader: GGUFReader) -> None:
    count = _int_value(reader, "split.count") or 1
    if count > 1:
        shard = (_int_value(reader, "split.no") or 0) + 1
        raise ModelError(
            f"{path} is shard {shard} of a model split into {count} files (split.count={count}); "
            "Shoal cannot inspect split GGUFs. Merge them first: "
            "`llama-gguf-split --merge <first-shard>.gguf merged.gguf`."
        )


def _build_info(path: Path, reader: GGUFReader) -> GGUFInfo:
    arch = _str_value(reader, "general.architecture")
    if arch is None:
        raise ValueError("general.architecture is missing")
    tensors = tuple(_tensor_info(t) for t in reader.tensors)
    file_size = path.stat().st_size
    _check_within(tensors, file_size)
    n_layers = _required_int(reader, f"{arch}.block_count")
    embd = _required_int(reader, f"{arch}.embedding_length")
    heads = _int_value(reader, f"{arch}.attention.head_count") or 0
    head_dim = embd // heads if heads else 0
    file_type = _int_value(reader, "general.file_type")
    names = {t.name for t in tensors}
    tied = _OUTPUT not in names and _EMBEDDINGS in names
    head, tail, other = _non_layer_bytes(tensors, n_layers, tied)
    return GGUFInfo(
        path=path.absolute(),
        file_size=file_size,
        version=_required_int(reader, "GGUF.version"),
        architecture=arch,
        name=_str_value(reader, "general.name"),
        n_layers=n_layers,
        context_length=_required_int(reader, f"{arch}.context_length"),
        embedding_length=embd,
        feed_forward_length=_int_value(reader, f"{arch}.feed_forward_length"),
        head_count=heads,
        head_count_kv=_int_value(reader, f"{arch}.attention.head_count_kv") or heads,
        key_length=_int_value(reader, f"{arch}.attention.key_length") or head_dim,
        value_length=_int_value(reader, f"{arch}.attention.value_length") or head_dim,
        vocab_size=_vocab_size(reader, arch),
        file_type=file_type,
        quantization=_quantization_label(file_type),
        alignment=int(reader.alignment),
        data_offset=int(reader.data_offset),
        metadata={
            k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")
        },
        tensors=tensors,
        layers=_layer_ranges(tensors, n_layers),
        head_bytes=head,
        tail_bytes=tail,
        other_bytes=other,
        tied_embeddings=tied,
    )


def _tensor_info(t: ReaderTensor) -> TensorInfo:
    match = _LAYER_PREFIX.match(t.name)
    return TensorInfo(
        name=t.name,
        ggml_type=t.tensor_type.name,
        shape=tuple(int(n) for n in t.shape.tolist()),
        offset=int(t.data_offset),
        nbytes=int(t.n_bytes),
        layer=int(match.group(1)) if match else None,
    )


def _check_within(tensors: tuple[TensorInfo, ...], file_size: int) -> None:
    for t in tensors:
        if t.offset + t.nbytes > file_size:
            raise ValueError(
                f"tensor {t.name} ends at byte {t.offset + t.nbytes}, "
                f"past the end of the file ({file_size} bytes; is it truncated?)"
            )


def _layer_ranges(tensors: tuple[TensorInfo, ...], n_layers: int) -> tuple[LayerRange, ...]:
    by_layer: dict[int, list[TensorInfo]] = {}
    for t in tensors:
        if t.layer is not None:
            by_layer.setdefault(t.layer, []).append(t)
    ranges = []
    for layer in range(n_layers):
        members = by_layer.get(layer)
        if not members:
            raise ValueError(
                f"block_count is {n_layers} but block {layer} has no tensors (blk.{layer}.*)"
            )
        ranges.append(
            LayerRange(
                layer=layer,
                start=min(t.offset for t in members),
                end=max(t.offset + t.nbytes for t in members),
                nbytes=sum(t.nbytes for t in members),
            )
        )
    return tuple(ranges)


def _non_layer_bytes(
    tensors: tuple[TensorInfo, ...], n_layers: int, tied: bool
) -> tuple[int, int, int]:
    """Bytes of the head (input layer), tail (output layer) and everything else."""
    head = tail = other = 0
    for t in tensors:
        if t.layer is not None and t.layer < n_layers:
            continue
        if t.name.startswith(_HEAD_PREFIX):
            head += t.nbytes
        elif t.name.startswith(_TAIL_PREFIXES):
            tail += t.nbytes
        else:
            other += t.nbytes
        if tied and t.name == _EMBEDDINGS:
            tail += t.nbytes
    return head, tail, other


def _vocab_size(reader: GGUFReader, arch: str) -> int | None:
    size = _int_value(reader, f"{arch}.vocab_size")
    if size is not None:
        return size
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return _array_length(tokens) if tokens is not None else None


def _quantization_label(file_type: int | None) -> str | None:
    if file_type is None:
        return None
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file type {file_type}"


# Metadata values


def _field_value(f: ReaderField) -> object:
    """A scalar as a plain Python value, an array as a short summary."""
    kind = f.types[0]
    if kind == GGUFValueType.ARRAY:
        item = GGUFValueType(int(f.parts[3][0])).name.lower()
        return f"array[{_array_length(f)}] of {item}"
    if kind == GGUFValueType.STRING:
        return bytes(f.parts[-1]).decode("utf-8", errors="replace")
    value: object = f.parts[-1].tolist()[0]
    return value


def _array_length(f: ReaderField) -> int:
    # A key/value array's parts are [key length, key, value type, item type, length, items...].
    return int(f.parts[4][0])


def _int_value(reader: GGUFReader, key: str) -> int | None:
    """An integer key, or the largest value of a per-layer integer array; None if absent."""
    f = reader.get_field(key)
    if f is None:
        return None
    if f.types[-1] not in _INT_TYPES:
        raise ValueError(f"{key} is {f.types[-1].name}, expected an integer")
    if f.types[0] == GGUFValueType.ARRAY:
        return max((int(v) for v in f.contents()), default=0)
    return int(f.parts[-1][0])


def _required_int(reader: GGUFReader, key: str) -> int:
    value = _int_value(reader, key)
    if value is None:
        raise ValueError(f"{key} is missing")
    return value


def _str_value(reader: GGUFReader, key: str) -> str | None:
    f = reader.get_field(key)
    if f is None:
        return None
    if f.types != [GGUFValueType.STRING]:
        raise ValueError(f"{key} is {f.types[0].name}, expected a string")
    return bytes(f.parts[-1]).decode("utf-8", errors="replace")


# Estimates


def _checked(info: GGUFInfo, layers: range) -> range:
    if len(layers) and (min(layers) < 0 or max(layers) >= info.n_layers):
        raise ValueError(f"layers {layers} are outside the model's 0..{info.n_layers - 1}")
    return layers


def _kv_elements_per_token(info: GGUFInfo, layers: range) -> int:
    per_layer = info.head_count_kv * (info.key_length + info.value_length)
    return per_layer * len(_checked(info, layers))


# JSON


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value
