"""A GGUF header's length from its first bytes (``gguf_header.data_offset``), against the
offset gguf-py's reader finds in whole files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.models.gguf_header import data_offset
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
