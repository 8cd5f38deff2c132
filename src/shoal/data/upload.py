"""One upload in progress: streamed into a hidden file in the storage folder, hashed as it
arrives, cut off as soon as it passes the size limit, and checked before it may take a name.

Two kinds of upload:

- **Resumable** (``?offset=N``, what ``shoal data upload`` sends): the bytes go into a partial
  file named by the sha256 the client declares (``.upload-SHA256.part``). When the client goes
  away the partial file stays, and ``GET /api/v1/storage/upload/SHA256`` answers how many bytes
  it holds; the client sends the rest with ``?offset=`` that many. The bytes already there are
  hashed again when an upload resumes, so the digest checked at the end covers the whole file.
- **One-shot** (a raw body without ``offset``, or the seed's multipart form): a temp file of
  its own, deleted whenever the upload does not end in a stored model.

Either way, a file whose sha256 or GGUF header does not check out is deleted, never renamed
into place: nothing corrupted is kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import AsyncIterable
from pathlib import Path

import anyio.to_thread

from shoal.data.errors import ChecksumMismatch, NotGGUF, TooLarge, UploadConflict
from shoal.models.errors import ModelError
from shoal.models.gguf_info import GGUF_MAGIC, GGUFInfo, inspect

log = logging.getLogger(__name__)

TEMP_PREFIX = ".upload-"
TEMP_SUFFIX = ".part"
FLUSH_BYTES = 4 << 20
"""Received bytes are buffered up to this much, then written and hashed in a thread."""
HASH_CHUNK = 4 << 20


def too_large(size: int, limit: int) -> TooLarge:
    return TooLarge(
        f"The upload is larger than this store accepts ({size} > {limit} bytes). Start the "
        "store with a larger --max-upload-bytes, or copy the file into its storage folder."
    )


def partial_path(storage: Path, sha256: str) -> Path:
    """Where a resumable upload of the file with this sha256 keeps its bytes."""
    return storage / f"{TEMP_PREFIX}{sha256}{TEMP_SUFFIX}"


def partial_size(storage: Path, sha256: str) -> int:
    """How many bytes of a resumable upload the store holds (0: none)."""
    try:
        return partial_path(storage, sha256).stat().st_size
    except FileNotFoundError:
        return 0


class Upload:
    """A hidden file in ``storage`` receiving one model's bytes; ``discard`` removes it,
    ``release`` leaves a resumable one for the next try. Blocking constructors: call them
    in a thread."""

    def __init__(self, path: Path, offset: int, max_bytes: int, *, resumable: bool) -> None:
        self.path = path
        self.size = offset
        self.max_bytes = max_bytes
        self.resumable = resumable
        self._digest = hashlib.sha256()
        mode = "r+b" if offset else "wb"
        self._file = path.open(mode)
        try:
            self._rehash(offset)
        except BaseException:
            self._file.close()
            raise

    @classmethod
    def one_shot(cls, storage: Path, max_bytes: int) -> Upload:
        fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=storage)
        os.close(fd)
        return cls(Path(name), 0, max_bytes, resumable=False)

    @classmethod
    def resume(cls, storage: Path, sha256: str, offset: int, max_bytes: int) -> Upload:
        """Continue (``offset`` > 0) or start over (0) the partial file of ``sha256``;
        ``UploadConflict`` when the store holds another number of bytes than ``offset``."""
        held = partial_size(storage, sha256)
        if offset not in (0, held):
            raise UploadConflict(
                f"The store holds {held} bytes of this upload, not {offset}: send the rest "
                f"from offset={held} (GET /api/v1/storage/upload/{sha256} says how many bytes "
                "it holds), or offset=0 to start over.",
                param="offset",
            )
        if offset > max_bytes:
            raise too_large(offset, max_bytes)
        return cls(partial_path(storage, sha256), offset, max_bytes, resumable=True)

    def _rehash(self, offset: int) -> None:
        """Hash the bytes already there (a resumed upload), and stand after them."""
        remaining = offset
        while remaining:
            chunk = self._file.read(min(HASH_CHUNK, remaining))
            if not chunk:
                break
            self._digest.update(chunk)
            remaining -= len(chunk)
        self._file.seek(offset)
        self._file.truncate()

    async def receive(self, chunks: AsyncIterable[bytes]) -> None:
        """Write and hash the body; raise ``TooLarge`` the moment it passes the limit."""
        buffer = bytearray()
        try:
            async for chunk in chunks:
                if self.size + len(buffer) + len(chunk) > self.max_bytes:
                    raise too_large(self.size + len(buffer) + len(chunk), self.max_bytes)
                buffer += chunk
                if len(buffer) >= FLUSH_BYTES:
                    data = bytes(buffer)
                    buffer.clear()
                    await anyio.to_thread.run_sync(self._write, data)
        finally:  # what arrived before the client went away is kept for a resumable upload
            if buffer:
                await anyio.to_thread.run_sync(self._write, bytes(buffer))

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._digest.update(data)
        self.size += len(data)

    def verify(self, expected_sha256: str | None) -> tuple[str, GGUFInfo]:
        """Close the file and check its sha256 (when the client gave one), then that it is a
        GGUF the store can describe; the digest and the GGUF's description."""
        self._file.close()
        actual = self._digest.hexdigest()
        if expected_sha256 is not None and actual != expected_sha256:
            raise ChecksumMismatch(
                f"The uploaded bytes have sha256 {actual}, not the {expected_sha256} given "
                "in sha256=. The wrong file was sent, or it changed while it was sent; nothing "
                "was kept. Check the file (`sha256sum FILE`) and upload it again.",
                param="sha256",
            )
        with self.path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise NotGGUF(
                f"The upload is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
                "nothing was kept. The store serves only GGUF models: convert the model with "
                "llama.cpp's convert scripts first."
            )
        try:
            return actual, inspect(self.path)
        except ModelError as exc:
            raise NotGGUF(
                f"The upload starts like a GGUF file but the store cannot read it, so nothing "
                f"was kept: {exc}"
            ) from None

    def release(self) -> None:
        """The client went away: keep a resumable upload's bytes, discard a one-shot's."""
        if not self.resumable:
            self.discard()
            return
        self._file.close()
        log.info("upload %s paused after %d bytes; it may resume", self.path.name, self.size)

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)
        log.info("upload %s discarded after %d bytes", self.path.name, self.size)
