"""Slots' KV caches kept across a model's eviction: saved before its llama-server stops, put
back into the slots after it loads again, so a returning conversation reuses its prefix
instead of computing it again.

What llama-server does (the pinned build, b11434: ``tools/server/server-context.cpp``,
``handle_slots_save``/``handle_slots_restore`` and the ``SERVER_TASK_TYPE_SLOT_*`` tasks;
checked on the binary by ``tests/worker/text/residency/test_kv_saves.py``):

* ``POST /slots/{id}?action=save`` with ``{"filename": NAME}`` writes slot ``id``'s cache to
  ``--slot-save-path`` + NAME (``llama_state_seq_save_file``: the slot's tokens, then its KV
  cells) and answers ``{"id_slot", "filename", "n_saved": tokens, "n_written": bytes,
  "timings": {"save_ms"}}``. It writes the file in place, not atomically.
* ``?action=restore`` reads it into slot ``id`` and answers ``{"id_slot", "filename",
  "n_restored": tokens, "n_read": bytes, "timings": {"restore_ms"}}``. The tokens come back
  with the cells, so the slot reuses the common prefix of its next prompt as any slot does (a
  job pinned there with ``id_slot``). A file that does not fit the slot's context or the KV
  cache, or whose cells do not match the model's KV shapes, is refused with a 400 ("Unable to
  restore slot: ...") and the slot is left empty. A missing file is a 400 too.
* Either waits while the slot runs a task (llama-server defers it until the slot is idle).
* Without ``--slot-save-path`` every slot action is a 501 ("This server does not support
  slots action"); the folder must exist when llama-server starts, or it will not start.
* NAME must pass ``fs_validate_filename``: no ``/ \\ : * ? " < > |`` or control characters,
  no ``..``, no leading or trailing space, no trailing ``.``, at most 255 bytes (a 400
  "Invalid filename" otherwise). Shoal's names are ``<nanoseconds>-<slot>.bin``.
* An empty slot saves a file of its header alone (``n_saved`` 0): Shoal never asks for one.

Shoal's rules:

* **Where.** ``<cache>/kv-saves/<alias>-<fingerprint>/`` (``folder``, the llama-server's
  ``--slot-save-path``): the alias made safe, and a hash of the model file (path, size,
  modification time) and llama-server's extra arguments (the KV cache's types among them), so
  that a cache goes back only into the model that computed it. Beside each ``.bin`` a
  ``.json`` record (``SlotSave``), written atomically once the save answered, says which
  prefix blocks (``protocol/prefix.py``'s chain, as the ``SlotTable`` holds it) the file
  holds: a ``.bin`` without one is a save that never finished, removed once it is
  ``ORPHAN_AGE_S`` old.
* **What is saved.** Each idle slot holding at least one whole block (256 bytes of content;
  less is not worth a file), most recently used first, leaving out one that another of them
  ``covers``. The slots are ``reserved`` meanwhile, so no job changes what they hold.
* **Which saves go.** A save ``covers`` an older one when it holds all the older one's
  blocks but perhaps its last (a chain's last hash may stand for part of a block): the same
  conversation saved again, or gone on by some turns. After each save the covered ones are
  removed, then the oldest saves of every model until they all fit the bound
  (``--kv-save-limit``).
* **What is put back.** After a load, the newest saves that no newer one covers, one into
  each idle, empty slot; each slot restored is told to the ``SlotTable`` (``restored``), whose
  summary, and so the router's ``CacheChanged``, follows. Restored files are kept: the model
  may stop again without saving (a crash), and saving those slots again replaces them. A
  file llama-server refuses is removed.
* **Bounded time.** Each action waits at most ``action_timeout_s``, a whole pass at most
  ``pass_timeout_s``; an action that fails or runs out of time is logged and the pass goes on
  (a save's partial file removed). Nothing raises: an eviction waits for this no longer than
  the pass's bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from shoal.worker.text import loopback
from shoal.worker.text.llama_server import LlamaServerConfig
from shoal.worker.text.slots import Slot, SlotTable

log = logging.getLogger(__name__)

ACTION_TIMEOUT_S = 30.0
"""One slot's save or restore: seconds for a few GiB of KV cache on a slow disk."""
PASS_TIMEOUT_S = 60.0
"""All of a model's slots, saved or restored: what an eviction waits at most."""
ORPHAN_AGE_S = 600.0
"""A ``.bin`` without its record, or a record's temporary file, this many seconds old is a
save that never finished (one still running is at most ``PASS_TIMEOUT_S`` old)."""
BIN = ".bin"
RECORD = ".json"
JSON_HEADERS = {"Content-Type": "application/json"}

T = TypeVar("T")


class SlotSave(BaseModel):
    """One slot's KV cache on disk: llama-server's ``<name>.bin`` and this, ``<name>.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    model: str
    """The model's alias."""
    slot: int
    """The slot it was saved from."""
    blocks: tuple[int, ...]
    """The slot's content chain (``Slot.blocks``)."""
    content: int
    """How many of ``blocks`` the router matches (``Slot.content``)."""
    tokens: int
    bytes: int
    saved_at_ns: int
    """``time.time_ns()`` when it was saved: newest first, oldest out."""
    seconds: float
    """How long llama-server took to write it."""


@dataclass(frozen=True, slots=True)
class Restored:
    slot: int
    save: SlotSave
    tokens: int
    seconds: float
    """How long llama-server took to read it back."""


class Refused(Exception):
    """llama-server answered a slot action with an error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def covers(newer: Sequence[int], older: Sequence[int]) -> bool:
    """Whether a cache holding the chain ``newer`` holds all of ``older`` but perhaps its
    last block (each hash covers every block before it)."""
    if not older:
        return True
    return len(newer) >= len(older) and tuple(newer[: len(older) - 1]) == tuple(older[:-1])


def distinct(items: Sequence[T], blocks: Callable[[T], Sequence[int]]) -> list[T]:
    """``items`` (newest first) without those a newer one kept ``covers``."""
    kept: list[T] = []
    for item in items:
        if not any(covers(blocks(k), blocks(item)) for k in kept):
            kept.append(item)
    return kept


def oldest_out(sizes: Sequence[int], max_bytes: int) -> int:
    """How many of the oldest files (``sizes``, oldest first) go so that the rest fit
    ``max_bytes``."""
    total = sum(sizes)
    n = 0
    while n < len(sizes) and total > max_bytes:
        total -= sizes[n]
        n += 1
    return n


def safe_name(alias: str) -> str:
    """``alias`` as a folder name: letters, digits, ``-``, ``_`` and ``.``, at most 64."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in alias)[:64] or "model"


def fingerprint(config: LlamaServerConfig) -> str:
    """What a saved cache is valid for: the model file (path, size, modification time) and
    llama-server's extra arguments (``--cache-type-k`` and the like)."""
    path = config.model_path.resolve()
    try:
        stat = path.stat()
        facts = [str(path), str(stat.st_size), str(stat.st_mtime_ns)]
    except OSError:
        facts = [str(path)]
    text = "\0".join([*facts, *config.extra_args])
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


class SlotSaves:
    """The saved KV caches of every model in ``root``, at most ``max_bytes`` together (0:
    saving is off)."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        *,
        action_timeout_s: float = ACTION_TIMEOUT_S,
        pass_timeout_s: float = PASS_TIMEOUT_S,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.action_timeout_s = action_timeout_s
        self.pass_timeout_s = pass_timeout_s

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def folder(self, config: LlamaServerConfig) -> Path | None:
        """The ``--slot-save-path`` for a llama-server of ``config`` (made here: llama-server
        will not start without it); None when saving is off or it serves embeddings."""
        if not self.enabled or config.embedding:
            return None
        path = self.root / f"{safe_name(config.alias)}-{fingerprint(config)}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def save(
        self, session: aiohttp.ClientSession, url: str, config: LlamaServerConfig, table: SlotTable
    ) -> tuple[SlotSave, ...]:
        """Save the caches of the slots worth it (see the module's rules) of the llama-server
        at ``url`` (started with ``config``) before it stops; what was saved."""
        folder = config.slot_save_path
        if folder is None or not self.enabled:
            return ()
        recent = sorted(
            (s for s in table.slots if not s.busy and s.content), key=lambda s: -s.last_used
        )
        candidates = distinct(recent, _slot_blocks)
        if not candidates:
            return ()
        folder.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.pass_timeout_s
        saved: list[SlotSave] = []
        with table.reserved(s.id for s in candidates) as ids:
            for slot in candidates:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "model %s: out of time (%g s) for saving slots; %d not saved",
                        config.alias,
                        self.pass_timeout_s,
                        len(candidates) - len(saved),
                    )
                    break
                if slot.id in ids:
                    timeout = min(left, self.action_timeout_s)
                    done = await self._save_one(session, url, config.alias, folder, slot, timeout)
                    if done is not None:
                        saved.append(done)
        if saved:
            await asyncio.to_thread(self._tidy, folder)
        return tuple(saved)

    async def restore(
        self, session: aiohttp.ClientSession, url: str, config: LlamaServerConfig, table: SlotTable
    ) -> tuple[Restored, ...]:
        """Put the newest saved caches of the model back into the empty slots of the
        llama-server at ``url`` (started with ``config``), and tell ``table``; what was
        restored."""
        folder = config.slot_save_path
        if folder is None or not self.enabled:
            return ()
        saves = await asyncio.to_thread(self.saves, folder)
        empty = [s.id for s in table.slots if not s.busy and not s.blocks]
        chosen = distinct(saves, _save_blocks)[: len(empty)]
        if not chosen:
            return ()
        deadline = time.monotonic() + self.pass_timeout_s
        done: list[Restored] = []
        with table.reserved(empty[: len(chosen)]) as ids:
            for save, slot in zip(chosen, ids, strict=False):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "model %s: out of time (%g s) for restoring slots",
                        config.alias,
                        self.pass_timeout_s,
                    )
                    break
                timeout = min(left, self.action_timeout_s)
                got = await self._restore_one(
                    session, url, config.alias, folder, save, slot, timeout
                )
                if got is not None:
                    done.append(got)
            for r in reversed(done):  # the newest told last: the most recently used
                table.restored(r.slot, r.save.blocks, r.save.blocks[: r.save.content])
        return tuple(done)

    def saves(self, folder: Path) -> list[SlotSave]:
        """The finished saves in ``folder``, newest first. Removes what is broken: a record
        that does not parse or lost its file, a file whose record never came."""
        try:
            entries = list(folder.iterdir())
        except FileNotFoundError:
            return []
        names = {p.name for p in entries}
        now = time.time()
        found: list[SlotSave] = []
        for path in entries:
            stem = path.name.removesuffix(path.suffix)
            if path.name.startswith(".") or (path.suffix == BIN and stem + RECORD not in names):
                if _age(path, now) > ORPHAN_AGE_S:
                    log.info("kv saves: removing %s, a save that never finished", path)
                    path.unlink(missing_ok=True)
            elif path.suffix == RECORD:
                save = _read(path)
                if save is None or save.name != stem or stem + BIN not in names:
                    log.warning("kv saves: removing %s, a broken record", path)
                    _drop(folder, stem)
                else:
                    found.append(save)
        return sorted(found, key=lambda s: s.saved_at_ns, reverse=True)

    def enforce_bound(self) -> int:
        """Remove the oldest saves of every model until they all fit ``max_bytes``; how many
        went."""
        entries: list[tuple[int, Path, str, int]] = []
        with contextlib.suppress(FileNotFoundError):
            for folder in self.root.iterdir():
                if folder.is_dir():
                    for s in self.saves(folder):
                        size = _size(folder / (s.name + BIN)) + _size(folder / (s.name + RECORD))
                        entries.append((s.saved_at_ns, folder, s.name, size))
        entries.sort()
        n = oldest_out([size for *_, size in entries], self.max_bytes)
        for _, folder, name, size in entries[:n]:
            log.info(
                "kv saves: dropping %s/%s (%d bytes) to stay under %d bytes",
                folder.name,
                name,
                size,
                self.max_bytes,
            )
            _drop(folder, name)
        return n

    def _tidy(self, folder: Path) -> None:
        """After a save: the saves a newer one covers go, then the oldest over the bound."""
        saves = self.saves(folder)
        kept = {s.name for s in distinct(saves, _save_blocks)}
        for s in saves:
            if s.name not in kept:
                log.debug("kv saves: %s/%s is covered by a newer save", folder.name, s.name)
                _drop(folder, s.name)
        self.enforce_bound()

    async def _save_one(
        self,
        session: aiohttp.ClientSession,
        url: str,
        alias: str,
        folder: Path,
        slot: Slot,
        timeout: float,
    ) -> SlotSave | None:
        name = f"{time.time_ns()}-{slot.id}"
        blocks, content = slot.blocks, len(slot.content)
        try:
            got = await _action(session, url, slot.id, "save", name, timeout)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, Refused) as exc:
            log.warning("model %s: slot %d's KV cache not saved: %s", alias, slot.id, _why(exc))
            (folder / (name + BIN)).unlink(missing_ok=True)  # what it wrote of it, if anything
            return None
        tokens, nbytes = got.get("n_saved"), got.get("n_written")
        if not isinstance(tokens, int) or not isinstance(nbytes, int) or tokens <= 0:
            log.warning("model %s: slot %d saved nothing (%.200s)", alias, slot.id, got)
            (folder / (name + BIN)).unlink(missing_ok=True)
            return None
        save = SlotSave(
            name=name,
            model=alias,
            slot=slot.id,
            blocks=blocks,
            content=content,
            tokens=tokens,
            bytes=nbytes,
            saved_at_ns=time.time_ns(),
            seconds=_ms(got, "save_ms") / 1000,
        )
        part = folder / f".{name}{RECORD}.part"
        part.write_bytes(save.model_dump_json().encode())
        os.replace(part, folder / (name + RECORD))
        log.info(
            "model %s: slot %d's KV cache saved: %d tokens, %d bytes in %.0f ms",
            alias,
            slot.id,
            tokens,
            nbytes,
            save.seconds * 1000,
        )
        return save

    async def _restore_one(
        self,
        session: aiohttp.ClientSession,
        url: str,
        alias: str,
        folder: Path,
        save: SlotSave,
        slot: int,
        timeout: float,
    ) -> Restored | None:
        try:
            got = await _action(session, url, slot, "restore", save.name, timeout)
        except Refused as exc:
            log.warning(
                "model %s: saved KV cache %s refused (%s); removing it", alias, save.name, exc
            )
            await asyncio.to_thread(_drop, folder, save.name)
            return None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.warning("model %s: slot %d not restored: %s", alias, slot, _why(exc))
            return None
        tokens = got.get("n_restored")
        if not isinstance(tokens, int) or tokens <= 0:
            log.warning("model %s: slot %d restored nothing (%.200s)", alias, slot, got)
            return None
        restored = Restored(slot, save, tokens, _ms(got, "restore_ms") / 1000)
        log.info(
            "model %s: slot %d restored from %s: %d tokens in %.0f ms",
            alias,
            slot,
            save.name,
            tokens,
            restored.seconds * 1000,
        )
        return restored


async def _action(
    session: aiohttp.ClientSession, url: str, slot: int, action: str, name: str, timeout: float
) -> dict[str, object]:
    """POST a slot action; its answer. Raises ``Refused`` for an error answer."""
    body = orjson.dumps({"filename": name + BIN})
    async with await loopback.post(
        session,
        f"{url}/slots/{slot}?action={action}",
        body,
        JSON_HEADERS,
        aiohttp.ClientTimeout(total=timeout),
    ) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise Refused(resp.status, _message(raw))
        got = orjson.loads(raw)
        return got if isinstance(got, dict) else {}


def _message(raw: bytes) -> str:
    """The message of llama-server's error JSON (``{"error": {"message": ...}}``), else the
    answer's start."""
    with contextlib.suppress(orjson.JSONDecodeError):
        got = orjson.loads(raw)
        error = got.get("error") if isinstance(got, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
    return raw[:200].decode(errors="replace")


def _ms(got: dict[str, object], key: str) -> float:
    timings = got.get("timings")
    value = timings.get(key) if isinstance(timings, dict) else None
    return float(value) if isinstance(value, int | float) else 0.0


def _why(exc: BaseException) -> str:
    return "timed out" if isinstance(exc, TimeoutError) else repr(exc)


def _slot_blocks(slot: Slot) -> tuple[int, ...]:
    return slot.blocks


def _save_blocks(save: SlotSave) -> tuple[int, ...]:
    return save.blocks


def _read(path: Path) -> SlotSave | None:
    try:
        return SlotSave.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def _drop(folder: Path, name: str) -> None:
    """Remove a save: its record first (a file without one is unfinished, removed later)."""
    (folder / (name + RECORD)).unlink(missing_ok=True)
    (folder / (name + BIN)).unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
