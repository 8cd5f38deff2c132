"""What GGUF file names say: split parts and quantization, as pure functions.

llama.cpp's ``gguf-split`` names the parts of a model ``<stem>-00001-of-00003.gguf`` and loads
the others from the first one's folder by those names, so every part must sit beside the first
one. Hugging Face repos name quantizations in the file name (``...-Q4_K_M.gguf``) or in a
folder (``Q4_K_M/...-00001-of-00002.gguf``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from shoal.models.catalog import QuantFile

GGUF_SUFFIX = ".gguf"

_SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<count>\d+)\.gguf$", re.IGNORECASE)
_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])((?:I|T)?Q\d(?:_[A-Za-z0-9]{1,3})*|BF16|F16|F32|MXFP4)(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_NOT_A_MODEL = ("mmproj",)
"""GGUFs in model repos that are not a model on their own (vision projectors)."""


@dataclass(frozen=True)
class SplitName:
    """Where a file sits in a split GGUF: part ``index`` (1-based) of ``count``."""

    stem: str
    index: int
    count: int
    width: int

    def part(self, index: int) -> str:
        return f"{self.stem}-{index:0{self.width}d}-of-{self.count:0{self.width}d}{GGUF_SUFFIX}"


def split_name(path: str) -> SplitName | None:
    """The split position of ``path`` (a file name or a path in a repo), None if not split."""
    match = _SPLIT_RE.match(path)
    if match is None:
        return None
    index, count = int(match["index"]), int(match["count"])
    if not 1 <= index <= count:
        return None
    return SplitName(match["stem"], index, count, len(match["index"]))


def split_parts(first_file: str) -> list[str]:
    """Every part of the split GGUF that ``first_file`` belongs to, first part first.

    ``x-00001-of-00003.gguf`` gives ``[x-00001-of-00003.gguf, x-00002-..., x-00003-...]``;
    a name that is not a split part gives ``[first_file]``. Folders in the path are kept.
    """
    split = split_name(first_file)
    if split is None:
        return [first_file]
    return [split.part(i) for i in range(1, split.count + 1)]


def guess_quantization(path: str) -> str | None:
    """The quantization named in a GGUF path (``Q4_K_M``, ``IQ2_XXS``, ``F16``...), or None.

    The last match wins, so a quantization folder or suffix beats words earlier in the name.
    """
    matches = _QUANT_RE.findall(path)
    return matches[-1].upper() if matches else None


@dataclass(frozen=True)
class RepoFile:
    """A file in a Hub repo, as the tree listing gives it."""

    path: str
    size: int
    sha256: str | None = None


def group_quants(files: Iterable[RepoFile]) -> tuple[QuantFile, ...]:
    """The quantizations in a repo's file list: each with its file or all its split parts.

    Only ``.gguf`` files count, projector files (``mmproj``) are left out. A file whose name
    names no quantization is listed under its own name (without ``.gguf`` and the split
    numbering). Sorted by size.
    """
    groups: dict[str, list[RepoFile]] = {}
    for file in files:
        name = PurePosixPath(file.path).name
        if not name.lower().endswith(GGUF_SUFFIX) or name.lower().startswith(_NOT_A_MODEL):
            continue
        quant = guess_quantization(file.path) or _model_name(file.path)
        groups.setdefault(quant, []).append(file)
    quants = [_quant_file(name, members) for name, members in groups.items()]
    return tuple(sorted(quants, key=lambda q: (q.size_bytes, q.quantization)))


def _model_name(path: str) -> str:
    """``x`` for ``d/x.gguf`` and for every part of ``d/x-0000N-of-0000M.gguf``."""
    split = split_name(path)
    name = split.stem if split is not None else path[: -len(GGUF_SUFFIX)]
    return PurePosixPath(name).name


def _quant_file(quantization: str, members: list[RepoFile]) -> QuantFile:
    ordered = sorted(members, key=_split_order)
    hashes = tuple(f.sha256 for f in ordered if f.sha256 is not None)
    return QuantFile(
        quantization=quantization,
        files=tuple(f.path for f in ordered),
        size_bytes=sum(f.size for f in ordered),
        size_exact=True,
        sha256=hashes if len(hashes) == len(ordered) else (),
    )


def _split_order(file: RepoFile) -> tuple[str, int]:
    split = split_name(file.path)
    return (file.path, 0) if split is None else (split.stem, split.index)
