"""One upload in progress: streamed into a hidden temp file in the storage folder, hashed as it
arrives, cut off as soon as it passes the size limit, and checked before it may take a name.

Nothing of a failed upload stays on disk: every failure path deletes the temp file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import AsyncIterable
from pathlib import Path

import anyio.to_thread

from shoal.data.errors import ChecksumMismatch, NotGGUF, TooLarge
from shoal.models.errors import ModelError
from shoal.models.gguf_info import GGUF_MAGIC, GGUFInfo, inspect

log = logging.getLogger(__name__)

TEMP_PREFIX = ".upload-"
TEMP_SUFFIX = ".part"
FLUSH_BYTES = 4 << 20
"""Received bytes are buffered up to this much, then written and hashed in a thread."""


def too_large(size: int, limit: int) -> TooLarge:
    return TooLarge(
        f"The upload is larger than this store accepts ({size} > {limit} bytes). Start the "
        "store with a larger --max-upload-bytes, or copy the file into its storage folder."
    )


class Upload:
    """A temp file in ``storage`` receiving one model's bytes; ``discard`` removes it."""

    def __init__(self, storage: Path, model_id: str, sha256: str, max_bytes: int) -> None:
        self.model_id = model_id
        self.expected_sha256 = sha256
        self.max_bytes = max_bytes
        self.size = 0
        self._digest = hashlib.sha256()
        fd, name = tempfile.mkstemp(
            prefix=f"{TEMP_PREFIX}{model_id}-", suffix=TEMP_SUFFIX, dir=storage
        )
        self.path = Path(name)
        self._file = os.fdopen(fd, "wb")

    async def receive(self, chunks: AsyncIterable[bytes]) -> None:
        """Write and hash the body; raise ``TooLarge`` the moment it passes the limit."""
        buffer = bytearray()
        async for chunk in chunks:
            self.size += len(chunk)
            if self.size > self.max_bytes:
                raise too_large(self.size, self.max_bytes)
            buffer += chunk
            if len(buffer) >= FLUSH_BYTES:
                data = bytes(buffer)
                buffer.clear()
                await anyio.to_thread.run_sync(self._write, data)
        if buffer:
            await anyio.to_thread.run_sync(self._write, bytes(buffer))

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._digest.update(data)

    def verify(self) -> GGUFInfo:
        """Close the file and check its sha256, then that it is a GGUF the store can describe."""
        self._file.close()
        actual = self._digest.hexdigest()
        if actual != self.expected_sha256:
            raise ChecksumMismatch(
                f"The uploaded bytes have sha256 {actual}, not the {self.expected_sha256} given "
                "in ?sha256=. The upload was incomplete or the wrong file was sent; nothing was "
                "kept. Check the file (`sha256sum FILE`) and upload it again.",
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
            return inspect(self.path)
        except ModelError as exc:
            raise NotGGUF(
                f"The upload starts like a GGUF file but the store cannot read it, so nothing "
                f"was kept: {exc}"
            ) from None

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)
        log.info("upload of %s discarded after %d bytes", self.model_id, self.size)
