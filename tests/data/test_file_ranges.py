"""GET/HEAD of a model file: whole, one byte range, unsatisfiable, ignored ranges; the parser."""

from __future__ import annotations

import pytest
from stores import TINY_ID, StoreServer

from shoal.data.errors import RangeNotSatisfiable
from shoal.data.http_range import parse_range
from shoal.pip_download import file_sha256

FILE = f"/api/v1/models/{TINY_ID}/file"


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        (None, 100, None),
        ("bytes=0-0", 100, (0, 1)),
        ("bytes=10-19", 100, (10, 20)),
        ("bytes=90-200", 100, (90, 100)),  # the end is clamped
        ("bytes=95-", 100, (95, 100)),
        ("bytes=-10", 100, (90, 100)),
        ("bytes=-500", 100, (0, 100)),
        ("Bytes = 1-2", 100, (1, 3)),
        ("bytes=0-1,5-6", 100, None),  # several ranges: the whole file
        ("bytes=5-2", 100, None),  # invalid: ignored
        ("bytes=abc", 100, None),
        ("bytes=-", 100, None),
        ("items=0-1", 100, None),
    ],
)
def test_parse_range(header: str | None, size: int, expected: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == expected


@pytest.mark.parametrize(
    ("header", "size"),
    [("bytes=100-", 100), ("bytes=100-200", 100), ("bytes=-0", 100), ("bytes=-1", 0)],
)
def test_parse_range_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable) as caught:
        parse_range(header, size)
    assert caught.value.headers == {"Content-Range": f"bytes */{size}"}


async def test_whole_file_with_etag(store: StoreServer) -> None:
    data = (store.storage / f"{TINY_ID}.gguf").read_bytes()
    etag = f'"{file_sha256(store.storage / f"{TINY_ID}.gguf")}"'
    r = await store.client.get(FILE)
    assert r.status_code == 200
    assert r.content == data
    assert r.headers["etag"] == etag
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["content-length"] == str(len(data))
    assert "content-range" not in r.headers
    for ignored in ("bytes=0-3,10-20", "bytes=9-2", "pages=1-2"):
        r = await store.client.get(FILE, headers={"Range": ignored})
        assert (r.status_code, r.content) == (200, data), ignored


async def test_single_ranges_are_206(store: StoreServer) -> None:
    data = (store.storage / f"{TINY_ID}.gguf").read_bytes()
    size = len(data)
    cases = {
        "bytes=0-3": (0, 4),
        "bytes=100-": (100, size),
        "bytes=-10": (size - 10, size),
        f"bytes={size - 5}-{size + 100}": (size - 5, size),
    }
    for header, (start, end) in cases.items():
        r = await store.client.get(FILE, headers={"Range": header})
        assert r.status_code == 206, header
        assert r.content == data[start:end]
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"
        assert r.headers["content-length"] == str(end - start)
    assert (await store.client.get(FILE, headers={"Range": "bytes=0-3"})).content == b"GGUF"


async def test_unsatisfiable_range_is_416(store: StoreServer) -> None:
    size = (store.storage / f"{TINY_ID}.gguf").stat().st_size
    for header in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0"):
        r = await store.client.get(FILE, headers={"Range": header})
        assert r.status_code == 416, header
        assert r.headers["content-range"] == f"bytes */{size}"
        assert r.json()["error"]["code"] == "range_not_satisfiable"


async def test_head_has_the_headers_and_no_body(store: StoreServer) -> None:
    size = (store.storage / f"{TINY_ID}.gguf").stat().st_size
    r = await store.client.head(FILE)
    assert r.status_code == 200
    assert r.content == b""
    assert r.headers["content-length"] == str(size)
    assert r.headers["etag"].strip('"') == file_sha256(store.storage / f"{TINY_ID}.gguf")
    r = await store.client.head(FILE, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206
    assert (r.headers["content-length"], r.content) == ("10", b"")
    assert r.headers["content-range"] == f"bytes 10-19/{size}"


async def test_if_range_guards_resumes(store: StoreServer) -> None:
    data = (store.storage / f"{TINY_ID}.gguf").read_bytes()
    etag = (await store.client.head(FILE)).headers["etag"]
    same = await store.client.get(FILE, headers={"Range": "bytes=4-", "If-Range": etag})
    assert (same.status_code, same.content) == (206, data[4:])
    other = await store.client.get(FILE, headers={"Range": "bytes=4-", "If-Range": '"other"'})
    assert (other.status_code, other.content) == (200, data)


async def test_large_file_streams_in_chunks(store: StoreServer) -> None:
    path = store.storage / "smollm2-135m-instruct.gguf"
    size = path.stat().st_size
    start = size - 3 * (1 << 20) - 12345
    async with store.client.stream(
        "GET", "/api/v1/models/smollm2-135m-instruct/file", headers={"Range": f"bytes={start}-"}
    ) as r:
        assert r.status_code == 206
        chunks = [chunk async for chunk in r.aiter_raw()]
    with path.open("rb") as f:
        f.seek(start)
        assert b"".join(chunks) == f.read()
