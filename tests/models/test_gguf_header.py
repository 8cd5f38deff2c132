"""A GGUF header's length and the file's least size from its first bytes
(``gguf_header.data_offset``, ``data_end``), against what gguf-py's reader finds in whole files;
``check_complete`` on files cut short."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.models.errors import ModelError
from shoal.models.gguf_header import (
    HEADER_CHUNK,
    check_complete,
    data_end,
    data_offset,
    next_header_read,
)
from shoal.models.gguf_info import inspect


@pytest.fixture(scope="module")
def headers(big_gguf: Path, model_path: Path) -> list[tuple[bytes, int]]:
    """(the first bytes up to and past the data offset, the data offset) of two real files."""
    found = []
    for path in (big_gguf, model_path):
        offset = inspect(path).data_offset
        with path.open("rb") as f:
            found.append((f.read(offset + 4096), offset))
    return found


def test_the_whole_header_gives_the_readers_data_offset(
    headers: list[tuple[bytes, int]],
) -> None:
    for data, offset in headers:
        assert data_offset(data) == offset
        assert data_offset(data[:offset]) == offset  # the padding is not needed


@settings(max_examples=50, deadline=None)
@given(fraction=st.floats(min_value=0.0, max_value=0.999))
def test_a_cut_header_asks_for_more_never_guesses(
    headers: list[tuple[bytes, int]], fraction: float
) -> None:
    for data, offset in headers:
        tensor_infos_end = offset - 31  # at most alignment - 1 bytes of padding follow them
        cut = int(fraction * tensor_infos_end)
        assert data_offset(data[:cut]) is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"GGML\x00\x00\x00\x00", "not a GGUF"),
        (b"GGUF\x01\x00\x00\x00", "version 1"),
    ],
)
def test_what_is_not_a_gguf_v2_or_v3_header_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        data_offset(data + b"\x00" * 32)


def test_the_whole_header_gives_where_the_last_tensor_ends(
    headers: list[tuple[bytes, int]], big_gguf: Path, model_path: Path
) -> None:
    for (data, offset), path in zip(headers, (big_gguf, model_path), strict=True):
        info = inspect(path)
        assert data_end(data[:offset]) == max(t.offset + t.nbytes for t in info.tensors)
        assert data_end(data[: offset - 32]) is None


def _cut_copy(source: Path, dest: Path, size: int, header: int) -> Path:
    """``dest``: ``source``'s first ``header`` bytes in a (sparse) file of ``size`` bytes."""
    with source.open("rb") as f, dest.open("wb") as out:
        out.write(f.read(min(header, size)))
        out.truncate(size)
    return dest


def test_a_whole_file_passes(model_path: Path, big_gguf: Path) -> None:
    check_complete(model_path)
    check_complete(big_gguf)


@pytest.mark.parametrize("missing", [1, 4096, 49_181_216])
def test_a_file_cut_in_its_tensor_data_names_both_sizes(
    tmp_path: Path, model_path: Path, missing: int
) -> None:
    whole = model_path.stat().st_size
    offset = inspect(model_path).data_offset
    cut = _cut_copy(model_path, tmp_path / "cut.gguf", whole - missing, offset)
    expected = f"{cut} is truncated: {whole - missing} of {whole} bytes; delete it and pull again."
    with pytest.raises(ModelError) as caught:
        check_complete(cut)
    assert str(caught.value) == expected


@pytest.mark.parametrize("size", [8, 300, 1_500_000])
def test_a_file_cut_in_its_header_says_so(tmp_path: Path, model_path: Path, size: int) -> None:
    cut = _cut_copy(model_path, tmp_path / "cut.gguf", size, size)
    with pytest.raises(ModelError, match=f"truncated: its {size} bytes end inside the GGUF header"):
        check_complete(cut)


def test_what_is_not_gguf_is_refused_by_check_complete(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF\x01\x00\x00\x00" + b"\x00" * 32)
    with pytest.raises(ModelError, match="not a GGUF model Shoal can use: GGUF version 1"):
        check_complete(path)


def test_a_file_without_tensors_needs_only_its_header() -> None:
    header = b"GGUF" + (3).to_bytes(4, "little") + bytes(16)  # v3, no tensors, no metadata
    assert data_offset(header) == 32  # the data would start at the alignment
    assert data_end(header) == 24


def test_reading_a_header_a_chunk_at_a_time(
    headers: list[tuple[bytes, int]], model_path: Path
) -> None:
    """``next_header_read``, the loop every remote reader runs: chunks from the start until the
    header ends, never past the file or ``MAX_HEADER``."""
    with model_path.open("rb") as f:
        data = f.read(8 * HEADER_CHUNK)
    offset = inspect(model_path).data_offset
    got = b""
    reads = []
    while isinstance(step := next_header_read(got, len(data)), tuple):
        reads.append(step)
        got += data[step[0] : step[1]]
    assert step == offset
    assert reads == [(i * HEADER_CHUNK, (i + 1) * HEADER_CHUNK) for i in range(len(reads))]
    assert len(reads) == -(-offset // HEADER_CHUNK)
    assert next_header_read(b"", 100) == (0, 100)  # a small file is read whole at once
    assert next_header_read(data[:100], 100) is None  # it ends inside its header
