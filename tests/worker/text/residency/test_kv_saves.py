"""Slots' KV caches saved before a model's llama-server stops and put back after it loads
again (``residency/kv_saves.py``): a returning conversation reuses its prefix, the slot table
(and so the router's summary) follows what was restored, the bound drops the oldest saves,
and a save that fails or hangs neither raises nor holds the eviction up.

The real llama-server and default model; ``SlotPinning`` chooses each job's slot as the
worker does, and the official ``openai`` client sends the chat there (``id_slot``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import openai
import pytest

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import BackendState, Endpoint, JobStart
from shoal.protocol.prefix import BLOCK_BYTES, chain_of
from shoal.units import GIB
from shoal.worker.text import loopback
from shoal.worker.text.llama_server import LlamaServer, LlamaServerConfig, command
from shoal.worker.text.pinning import SlotPinning
from shoal.worker.text.residency.kv_saves import (
    BIN,
    RECORD,
    SlotSave,
    SlotSaves,
    covers,
    distinct,
    oldest_out,
    safe_name,
)
from shoal.worker.text.slots import SLOT_MAX_BLOCKS, SlotTable

MODEL = "smol"
SYSTEM_A = " ".join(
    f"Rule {i}: always answer politely and briefly, citing rule {i}." for i in range(40)
)
"""About 680 prompt tokens with the chat template."""
SYSTEM_B = " ".join(f"Fact {i}: the lighthouse keeper owns {i} blue lanterns." for i in range(30))


def _config(
    llama_server: Path, model_path: Path, tmp_path: Path, **kw: object
) -> LlamaServerConfig:
    base = LlamaServerConfig(
        binary=llama_server,
        model_path=model_path,
        alias=MODEL,
        slots=2,
        ctx_size=2048,
        log_file=tmp_path / "llama-server.log",
        threads=2,
        max_restarts=0,
    )
    return dataclasses.replace(base, **kw)


@asynccontextmanager
async def running(config: LlamaServerConfig) -> AsyncIterator[LlamaServer]:
    """A real llama-server of ``config``, READY; stopped (its process gone) on exit."""
    ready = asyncio.Event()

    def on_state(state: BackendState, detail: str) -> None:
        if state is BackendState.READY:
            ready.set()

    server = LlamaServer(config, on_state)
    task = asyncio.create_task(server.run())
    try:
        async with asyncio.timeout(120):
            await ready.wait()
        yield server
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert server.pid is None


def job(messages: list[dict[str, str]]) -> JobStart:
    return JobStart(
        job_id=JobId(f"j{time.monotonic_ns()}"),
        model=ModelName(MODEL),
        endpoint=Endpoint.CHAT,
        stream=False,
        body={"messages": messages},
    )


async def chat(
    pinning: SlotPinning, url: str, messages: list[dict[str, str]]
) -> tuple[int, openai.types.chat.ChatCompletion]:
    """One chat on the slot the worker would pin it to: its slot and the answer."""
    async with (
        pinning.pin(job(messages)) as pin,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client,
    ):
        assert pin is not None
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"id_slot": pin.slot},
        )
        return pin.slot, answer


def cached_tokens(answer: openai.types.chat.ChatCompletion) -> int:
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


def conversation(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# --- llama-server's command line -----------------------------------------------------


def test_the_command_line_names_the_slot_save_path(tmp_path: Path) -> None:
    config = LlamaServerConfig(
        binary=Path("/bin/llama-server"),
        model_path=Path("/m.gguf"),
        alias="m",
        slots=2,
        ctx_size=512,
        log_file=tmp_path / "log",
    )
    assert "--slot-save-path" not in command(config, 8080)
    argv = command(dataclasses.replace(config, slot_save_path=tmp_path / "saves"), 8080)
    at = argv.index("--slot-save-path")
    assert argv[at + 1] == str(tmp_path / "saves")


# --- the pure rules -----------------------------------------------------------------------


def chain(text: bytes) -> tuple[int, ...]:
    return chain_of("m", text, SLOT_MAX_BLOCKS, tail=True)


SYS = b"s" * (10 * BLOCK_BYTES)
TURN_1 = chain(SYS + b"user: hello")
TURN_2 = chain(SYS + b"user: hello" + b"assistant: hi" + b"u" * BLOCK_BYTES)
OTHER = chain(b"o" * (10 * BLOCK_BYTES) + b"user: hello")


@pytest.mark.parametrize(
    ("newer", "older", "expected"),
    [
        (TURN_1, TURN_1, True),  # the same conversation, saved again
        (TURN_2, TURN_1, True),  # gone on: all of it but its last, partial block
        (TURN_1, TURN_2, False),  # shorter: not all of it
        (OTHER, TURN_1, False),
        (TURN_1, (), True),
        (TURN_1[:3], TURN_1[:3] + (7,), False),  # a longer one is never covered
    ],
)
def test_covers(newer: tuple[int, ...], older: tuple[int, ...], expected: bool) -> None:
    assert covers(newer, older) is expected


def test_distinct_keeps_the_newest_of_each_conversation() -> None:
    newest_first = [TURN_2, OTHER, TURN_1]
    assert distinct(newest_first, lambda b: b) == [TURN_2, OTHER]
    assert distinct([TURN_1, TURN_1], lambda b: b) == [TURN_1]


@pytest.mark.parametrize(
    ("sizes", "bound", "out"),
    [([], 10, 0), ([5, 5], 10, 0), ([5, 5, 5], 10, 1), ([20, 1], 10, 1), ([4, 20], 10, 2)],
)
def test_oldest_out(sizes: list[int], bound: int, out: int) -> None:
    assert oldest_out(sizes, bound) == out


def test_folder_names_are_safe_and_follow_the_model(
    tmp_path: Path, llama_server: Path, model_path: Path
) -> None:
    assert safe_name("org/repo:Q4_K_M") == "org_repo_Q4_K_M"
    assert safe_name("..") == ".."  # never a folder alone: the fingerprint follows
    saves = SlotSaves(tmp_path, GIB)
    config = _config(llama_server, model_path, tmp_path, alias="org/repo:Q4")
    folder = saves.folder(config)
    assert folder is not None and folder.is_dir() and folder.parent == tmp_path
    assert folder.name.startswith("org_repo_Q4-")
    assert saves.folder(config) == folder
    other = dataclasses.replace(config, extra_args=("--cache-type-k", "q8_0"))
    assert saves.folder(other) != folder  # another KV cache: never restored there
    assert SlotSaves(tmp_path, 0).folder(config) is None  # --kv-save-limit 0
    assert saves.folder(dataclasses.replace(config, embedding=True)) is None


# --- the bound and the files on disk ------------------------------------------------------


def _write_save(folder: Path, name: str, blocks: tuple[int, ...], size: int, at: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / (name + BIN)).write_bytes(b"\0" * size)
    save = SlotSave(
        name=name,
        model=MODEL,
        slot=0,
        blocks=blocks,
        content=len(blocks),
        tokens=10,
        bytes=size,
        saved_at_ns=at,
        seconds=0.0,
    )
    (folder / (name + RECORD)).write_text(save.model_dump_json())


def test_the_bound_drops_the_oldest_saves_of_every_model(tmp_path: Path) -> None:
    mib = 1 << 20
    saves = SlotSaves(tmp_path, 3 * mib)
    a, b = tmp_path / "a-1", tmp_path / "b-2"
    _write_save(a, "1-0", (1,), mib, at=1)
    _write_save(b, "2-0", (2,), mib, at=2)
    _write_save(a, "3-0", (3,), mib, at=3)
    _write_save(b, "4-0", (4,), mib, at=4)
    assert saves.enforce_bound() == 2  # 4 MiB and the records: the two oldest go
    assert [s.name for s in saves.saves(a)] == ["3-0"]
    assert [s.name for s in saves.saves(b)] == ["4-0"]
    assert not (a / "1-0.bin").exists() and not (a / "1-0.json").exists()


def test_broken_and_unfinished_saves_are_removed(tmp_path: Path) -> None:
    saves = SlotSaves(tmp_path, GIB)
    folder = tmp_path / "m-1"
    _write_save(folder, "1-0", (1,), 10, at=1)
    (folder / "2-0.json").write_text("{not json")
    (folder / "2-0.bin").write_bytes(b"x")
    (folder / "3-0.bin").write_bytes(b"x")  # a save still being written: young, kept
    (folder / "4-0.bin").write_bytes(b"x")  # one that never finished
    old = time.time() - 3600
    os.utime(folder / "4-0.bin", (old, old))
    assert [s.name for s in saves.saves(folder)] == ["1-0"]
    assert sorted(p.name for p in folder.iterdir()) == ["1-0.bin", "1-0.json", "3-0.bin"]


# --- with the real llama-server ------------------------------------------------------------


async def test_a_returning_conversation_reuses_its_restored_prefix(
    llama_server: Path, model_path: Path, tmp_path: Path
) -> None:
    saves = SlotSaves(tmp_path / "kv-saves", GIB)
    config = _config(llama_server, model_path, tmp_path)
    config = dataclasses.replace(config, slot_save_path=saves.folder(config))
    first_a = conversation(SYSTEM_A, "Hello there, which rule comes first?")
    first_b = conversation(SYSTEM_B, "How many lanterns in all?")
    async with loopback.session() as session:
        reports: list[tuple[int, ...]] = []
        table = SlotTable(2, reports.append)
        async with running(config) as server:
            pinning = SlotPinning(table, session, lambda: server.url)
            slot_a, answer_a = await chat(pinning, server.url, first_a)
            slot_b, _ = await chat(pinning, server.url, first_b)
            assert slot_a != slot_b
            prefix = answer_a.usage.prompt_tokens if answer_a.usage else 0
            assert prefix >= 300
            before = table.summary()
            saved = await saves.save(session, server.url, config, table)
        assert {s.slot for s in saved} == {slot_a, slot_b}
        assert all(s.tokens > 0 and s.bytes > 0 for s in saved)
        assert not any(slot.busy for slot in table.slots)  # the reservation ended

        reports_after: list[tuple[int, ...]] = []
        table = SlotTable(2, reports_after.append)
        async with running(config) as server:
            restored = await saves.restore(session, server.url, config, table)
            assert len(restored) == 2
            assert table.summary() == before  # what the router is told follows the restore
            assert reports_after[-1] == before
            pinning = SlotPinning(table, session, lambda: server.url)
            content = answer_a.choices[0].message.content or ""
            back = [*first_a, {"role": "assistant", "content": content}]
            back.append({"role": "user", "content": "And the second rule?"})
            slot, answer = await chat(pinning, server.url, back)
    [saved_a] = [s for s in saved if s.slot == slot_a]
    [restored_a] = [r for r in restored if r.save.name == saved_a.name]
    assert slot == restored_a.slot  # pinned to the slot its conversation was restored into
    assert cached_tokens(answer) >= 0.9 * prefix, answer.usage
    # saved files are kept after the restore
    assert [s.name for s in saves.saves(config.slot_save_path or Path())] != []


async def test_a_busy_slot_is_not_saved_and_the_same_conversation_is_saved_once(
    llama_server: Path, model_path: Path, tmp_path: Path
) -> None:
    saves = SlotSaves(tmp_path / "kv-saves", GIB)
    config = _config(llama_server, model_path, tmp_path)
    folder = saves.folder(config)
    assert folder is not None
    config = dataclasses.replace(config, slot_save_path=folder)
    async with loopback.session() as session:
        table = SlotTable(2, lambda _: None)
        async with running(config) as server:
            pinning = SlotPinning(table, session, lambda: server.url)
            slot_a, _ = await chat(pinning, server.url, conversation(SYSTEM_A, "Hi"))
            slot_b, _ = await chat(pinning, server.url, conversation(SYSTEM_B, "Hi"))
            busy = table.slots[slot_b]
            async with table.hold(busy.blocks, busy.content) as (held, _):
                assert held == slot_b
                saved = await saves.save(session, server.url, config, table)
                assert table.slots[slot_b].busy  # left to its job
            assert [s.slot for s in saved] == [slot_a]
            again = await saves.save(session, server.url, config, table)
    assert {s.slot for s in again} == {slot_a, slot_b}
    on_disk = saves.saves(folder)
    assert len(on_disk) == 2  # slot a's first save was covered by its second: removed
    assert saved[0].name not in {s.name for s in on_disk}


async def test_a_file_llama_server_refuses_is_removed(
    llama_server: Path, model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saves = SlotSaves(tmp_path / "kv-saves", GIB)
    config = _config(llama_server, model_path, tmp_path)
    folder = saves.folder(config)
    assert folder is not None
    config = dataclasses.replace(config, slot_save_path=folder)
    _write_save(folder, "1-0", (11, 12), 4096, at=1)  # not a state file
    table = SlotTable(2, lambda _: None)
    async with loopback.session() as session, running(config) as server:
        with caplog.at_level(logging.WARNING):
            restored = await saves.restore(session, server.url, config, table)
    assert restored == ()
    assert table.summary() == ()
    assert list(folder.iterdir()) == []
    assert "refused" in caplog.text


async def test_a_save_to_a_server_gone_is_logged_and_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saves = SlotSaves(tmp_path / "kv-saves", GIB)
    folder = tmp_path / "kv-saves" / "m"
    folder.mkdir(parents=True)
    config = LlamaServerConfig(
        binary=Path("/bin/false"),
        model_path=Path("/m.gguf"),
        alias=MODEL,
        slots=2,
        ctx_size=512,
        log_file=tmp_path / "log",
        slot_save_path=folder,
    )
    table = _filled_table()
    async with loopback.session() as session:
        with caplog.at_level(logging.WARNING):
            saved = await saves.save(session, closed_url(), config, table)
    assert saved == ()
    assert "not saved" in caplog.text
    assert list(folder.iterdir()) == []
    assert not any(slot.busy for slot in table.slots)


async def test_a_save_that_hangs_is_given_up_in_bounded_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saves = SlotSaves(tmp_path / "kv-saves", GIB, action_timeout_s=0.5, pass_timeout_s=0.8)
    folder = tmp_path / "kv-saves" / "m"
    folder.mkdir(parents=True)
    config = LlamaServerConfig(
        binary=Path("/bin/false"),
        model_path=Path("/m.gguf"),
        alias=MODEL,
        slots=2,
        ctx_size=512,
        log_file=tmp_path / "log",
        slot_save_path=folder,
    )
    table = _filled_table(3)  # 0.5 s, 0.3 s, then out of time

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the request, answers nothing, until the client leaves
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, loopback.session() as session:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            saved = await saves.save(session, f"http://127.0.0.1:{port}", config, table)
        took = time.monotonic() - started
    assert saved == ()
    assert took < 2.0  # the pass's bound, not the hang
    assert "timed out" in caplog.text and "out of time" in caplog.text


def _filled_table(slots: int = 2) -> SlotTable:
    """Slots holding different prompts, as after some jobs (no llama-server behind them)."""
    table = SlotTable(slots, lambda _: None)
    for i, slot in enumerate(table.slots):
        slot.blocks = slot.content = chain(bytes([65 + i]) * 3 * BLOCK_BYTES)
        slot.last_used = i + 1
    return table


def closed_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
