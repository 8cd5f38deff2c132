"""A job's POST to llama-server goes out on a connection opened before it came: as each
answer ends the worker opens the next (``loopback.open_spare``), since llama-server closes a
connection after every streamed answer. Real llama-server, the default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from cluster import plain_llama_server
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import Endpoint, JobDone, JobStart
from shoal.worker.jobs.sink import JobOutcome
from shoal.worker.text import loopback
from shoal.worker.text.backend import Backend, BackendTarget

MODEL = "m"


@pytest.fixture(scope="module")
def llama_url(
    llama_server: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    args = ("--alias", MODEL, "-np", "1", "-c", "2048", "--threads", "1", "--no-webui")
    log = tmp_path_factory.mktemp("llama") / "llama.log"
    with plain_llama_server(llama_server, model_path, log, *args) as url:
        yield url


class Outcomes:
    def __init__(self) -> None:
        self.outcomes: list[JobOutcome] = []

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        return

    def send(self, message: JobOutcome, /) -> None:
        self.outcomes.append(message)


def _job(n: int) -> JobStart:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi?"}],
    }
    return JobStart(
        job_id=JobId(f"j{n}"),
        model=ModelName(MODEL),
        endpoint=Endpoint.CHAT,
        stream=True,
        body=body,
    )


async def _connections_of_jobs(url: str, spare_path: str | None) -> list[str]:
    """How each job's POST got its connection: "new" or "ready"."""
    got: list[str] = []

    async def on_start(
        _: object, ctx: SimpleNamespace, params: aiohttp.TraceRequestStartParams
    ) -> None:
        ctx.method = params.method

    async def on_create(_: object, ctx: SimpleNamespace, __: object) -> None:
        if ctx.method == "POST":
            got.append("new")

    async def on_reuse(_: object, ctx: SimpleNamespace, __: object) -> None:
        if ctx.method == "POST":
            got.append("ready")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    trace.on_connection_create_end.append(on_create)
    trace.on_connection_reuseconn.append(on_reuse)
    connector = aiohttp.TCPConnector(keepalive_timeout=loopback.KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:
        target = BackendTarget(MODEL, stream_upstream=True, token_ids=True, spare_path=spare_path)
        backend = Backend(target, session, lambda: url)
        for n in range(3):
            sink = Outcomes()
            await backend.run(_job(n), sink)
            assert sink.outcomes == [JobDone(job_id=JobId(f"j{n}"))]
    return got


async def test_each_job_after_the_first_finds_its_connection_ready(llama_url: str) -> None:
    assert await _connections_of_jobs(llama_url, "/health") == ["new", "ready", "ready"]


async def test_without_a_spare_each_job_opens_its_own(llama_url: str) -> None:
    """What the spare saves: llama-server closed every streamed answer's connection."""
    got = await _connections_of_jobs(llama_url, None)
    assert got.count("new") >= 3
