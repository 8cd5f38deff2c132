"""Parts of a GGUF on the Hugging Face Hub, fetched with HTTP ``Range``: never the whole file.

A stage of a split model pre-seeds its RPC cache with the tensors of its layers
(``worker.shards.rpc_seed``). When it has no copy of the model, it fetches from the Hub's resolve
URL (pinned to the commit the ``HEAD`` call names, through huggingface_hub's session, token
and endpoint like every download: ``hub``) only:

1. the header, a chunk at a time until ``gguf_header.next_header_read`` says where it ends;
2. the tensors ``stage_tensors`` gives the stage (those llama.cpp asks for by hash), their
   ranges merged where only alignment padding separates them (``byte_ranges``).

Both go at their offsets into a sparse file of the model's full size in
``models/hub-layers/`` (like the model store's layer pull), renamed into place when complete,
so the file parses like the model itself and a redeploy finds it without a request. A server
that ignores ``Range`` is refused before its body is read. Offline (``HF_HUB_OFFLINE``,
``--offline``) nothing is fetched.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from huggingface_hub.utils._headers import build_hf_headers

from shoal.models import hub_cache
from shoal.models.byte_ranges import merge_ranges
from shoal.models.errors import HubError
from shoal.models.gguf_header import MAX_HEADER, next_header_read
from shoal.models.gguf_info import inspect
from shoal.models.hub import DOWNLOAD_ATTEMPTS, HubConfig, locate
from shoal.models.hub_errors import HUB_FAILURES, hub_error
from shoal.models.hub_transfer import RETRYABLE, back_off, stream
from shoal.models.stage_tensors import stage_tensors
from shoal.progress import BYTES_UNIT, Progress

logger = logging.getLogger(__name__)

_READ = 1 << 20
_Sink = Callable[[bytes], None]


@dataclass(frozen=True)
class HubFile:
    """One GGUF file of a Hub repo, as the router pinned it."""

    repo: str
    filename: str
    revision: str
    sha256: str | None
    size: int | None


@dataclass(frozen=True)
class StageSlice:
    path: Path
    """A sparse GGUF of the model's size: its header and the stage's hashed tensors."""
    fetched: int
    """Bytes received from the Hub for it (0: it was there from an earlier deploy)."""


def slice_path(cache_dir: Path, file: HubFile, first: int, last: int, output: bool) -> Path:
    name = Path(file.filename).name.removesuffix(".gguf")
    tail = "-output" if output else ""
    folder = hub_cache.hub_dir(cache_dir).parent / "hub-layers" / file.repo.replace("/", "--")
    return folder / f"{name}@{file.revision[:16]}-layers-{first}-{last}{tail}.gguf"


def fetch_stage_slice(
    file: HubFile, first: int, last: int, output: bool, cache_dir: Path, config: HubConfig
) -> StageSlice:
    """The tensors a stage holding layers ``first..last`` (and the output layer when
    ``output``) is asked for by hash, and the header, fetched by ``Range``. Blocking.

    Raises ``HubError`` (offline, unreachable, the file changed, ``Range`` ignored).
    """
    dest = slice_path(cache_dir, file, first, last, output)
    if dest.exists():
        return StageSlice(dest, 0)
    url, commit, size = locate(file.repo, file.filename, file.revision, config, file.sha256)
    if size is None or (file.size is not None and size != file.size):
        raise HubError(
            f"{file.filename} of {file.repo} at {commit} has {size} bytes, but the router "
            f"planned with {file.size}: the file changed; redeploy to plan with the new one."
        )
    where = f"{file.filename} of {file.repo} ({commit})"
    source = _Ranges(url, _headers(config), where, config, file)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        with part.open("wb") as out:
            out.truncate(size)
            header = source.header(size)
            out.write(header)
            out.flush()
            info = inspect(part)
            tensors = stage_tensors(info, first, last, output)
            spans = merge_ranges(
                ((t.offset, t.offset + t.nbytes) for t in tensors), max_gap=info.alignment - 1
            )
            total = sum(end - start for start, end in spans)
            with Progress(f"Fetching layers {first}-{last} of {where}", total, BYTES_UNIT) as bar:
                for start, end in spans:
                    source.copy(start, end, out, bar)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    logger.info(
        "fetched %d bytes of %s for layers %d-%d%s (of %d): header %d, %d tensors",
        source.received,
        where,
        first,
        last,
        " and the output" if output else "",
        size,
        len(header),
        len(tensors),
    )
    return StageSlice(dest, source.received)


def fetch_header(file: HubFile, config: HubConfig) -> bytes:
    """The GGUF header of ``file`` (metadata and tensor table), fetched by ``Range`` a chunk at
    a time: what a fit needs to know about a model before downloading it. Blocking."""
    url, commit, size = locate(file.repo, file.filename, file.revision, config, file.sha256)
    where = f"{file.filename} of {file.repo} ({commit})"
    source = _Ranges(url, _headers(config), where, config, file)
    header = source.header(size or file.size or MAX_HEADER)
    logger.info("read the %d-byte GGUF header of %s", len(header), where)
    return header


def _headers(config: HubConfig) -> dict[str, str]:
    headers = build_hf_headers(token=config.auth)
    headers["Accept-Encoding"] = "identity"  # Range offsets count file bytes
    return headers


class _Ranges:
    """Byte ranges of one remote file, each request retried from where it broke off."""

    def __init__(
        self, url: str, headers: Mapping[str, str], where: str, config: HubConfig, file: HubFile
    ) -> None:
        self.url = url
        self.headers = headers
        self.where = where
        self.config = config
        self.file = file
        self.received = 0

    def header(self, size: int) -> bytes:
        data = b""
        while isinstance(step := next_header_read(data, size), tuple):
            data += self.read(*step)
        if step is None:
            raise HubError(f"{self.where} has no complete GGUF header in its first bytes")
        return data[:step]

    def read(self, start: int, end: int) -> bytes:
        chunks: list[bytes] = []
        self._retrying(start, end, chunks.append)
        return b"".join(chunks)

    def copy(self, start: int, end: int, out: BinaryIO, progress: Progress) -> None:
        out.seek(start)

        def write(chunk: bytes) -> None:
            out.write(chunk)
            progress.advance(len(chunk))

        self._retrying(start, end, write)

    def _retrying(self, start: int, end: int, sink: _Sink) -> None:
        failures = 0
        at = start
        while at < end:
            try:
                at = self._get(at, end, sink)
            except RETRYABLE as exc:
                failures += 1
                if failures >= DOWNLOAD_ATTEMPTS:
                    raise HubError(
                        f"fetching bytes {at}-{end} of {self.where} failed {failures} "
                        f"time(s), last: {exc or type(exc).__name__}"
                    ) from exc
                logger.warning("%s: a range request broke off (%s)", self.where, exc)
                time.sleep(back_off(failures))  # back-off between retries, not polling
            except HUB_FAILURES as exc:
                f = self.file
                raise hub_error(exc, self.config, f.repo, f.filename, f.revision) from exc

    def _get(self, start: int, end: int, sink: _Sink) -> int:
        """Bytes ``start..end`` into ``sink``, as far as they come; where they stopped."""
        headers = {**self.headers, "Range": f"bytes={start}-{end - 1}"}
        with stream(self.url, headers) as response:
            given = response.headers.get("Content-Range", "")
            if response.status_code != 206 or not given.startswith(f"bytes {start}-"):
                raise HubError(
                    f"the server of {self.where} ignored the byte range asked for (HTTP "
                    f"{response.status_code}, Content-Range {given!r}); a stage never fetches "
                    "the whole file to pre-seed. Let the head send the weights, or give the "
                    "stage a copy of the model."
                )
            at = start
            for chunk in response.iter_bytes(_READ):
                chunk = chunk[: end - at]
                sink(chunk)
                at += len(chunk)
                self.received += len(chunk)
                if at >= end:
                    break
            return at
