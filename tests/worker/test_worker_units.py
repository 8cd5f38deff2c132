"""Small pieces of the worker: backoff, router URL forms, outbox framing, SSE parsing, shard
orders it cannot carry out."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from link_rig import router_link
from shoal.protocol.ids import JobId
from shoal.protocol.messages import JobDone, decode_worker_message
from shoal.protocol.shards import ShardRole, ShardStart, ShardState, ShardStatus, StoreFile
from shoal.worker.backoff import Backoff
from shoal.worker.link.outbox import Outbox, frames
from shoal.worker.settings import WorkerSettings, router_ws_url
from shoal.worker.text.backend_errors import context_needed, error_from_body
from shoal.worker.text.plan import store_base
from shoal.worker.text.streams import sse_data


@given(st.integers(0, 50), st.floats(0, 1))
def test_backoff_is_bounded_and_jittered(attempt: int, draw: float) -> None:
    b = Backoff(base=0.5, factor=2, cap=30)
    ceiling = min(30, 0.5 * 2**attempt)
    assert ceiling / 2 <= b.delay(attempt, draw) <= ceiling


def test_failover_tries_every_router_before_backing_off() -> None:
    b = Backoff(base=1, factor=2, cap=30)
    assert [b.failover_delay(n, 1, draw=1.0) for n in range(3)] == [1, 2, 4]
    assert [b.failover_delay(n, 3, draw=1.0) for n in range(7)] == [0, 0, 1, 0, 0, 2, 0]


def test_several_router_urls() -> None:
    settings = WorkerSettings(router_url="10.0.0.5:8000, wss://r.example")
    assert settings.ws_urls == ("ws://10.0.0.5:8000/ws/worker", "wss://r.example/ws/worker")
    with pytest.raises(ValidationError, match="at least one router URL"):
        WorkerSettings(router_url=" , ")


@pytest.mark.parametrize(
    ("given_url", "expected"),
    [
        ("10.0.0.5:8000", "ws://10.0.0.5:8000/ws/worker"),
        ("router.lan:8000", "ws://router.lan:8000/ws/worker"),
        ("http://r:1", "ws://r:1/ws/worker"),
        ("https://r:1/", "wss://r:1/ws/worker"),
        ("wss://r.example/shoal/ws/worker", "wss://r.example/shoal/ws/worker"),  # a proxy's
        ("ws://r:9", "ws://r:9/ws/worker"),
        ("HTTPS://r.example", "wss://r.example/ws/worker"),  # a scheme's own port: 443
        ("[::1]:8000", "ws://[::1]:8000/ws/worker"),
        ("r:1/ws/worker/", "ws://r:1/ws/worker"),
        ("wss://r:1/ws/worker?token=t", "wss://r:1/ws/worker?token=t"),
    ],
)
def test_router_url_forms(given_url: str, expected: str) -> None:
    assert router_ws_url(given_url) == expected


@pytest.mark.parametrize(
    ("given_url", "says"),
    [
        # The banner's Endpoint line, pasted: the clients' path.
        ("http://127.0.0.1:8000/v1", "has the path /v1, which is not the router's worker "
         "socket: workers dial /ws/worker, added for you; drop /v1: give http://127.0.0.1:8000"),
        ("wss://r.example/custom/path", "drop /custom/path: give wss://r.example"),
        ("htp://host:8000", "has the unknown scheme 'htp': give ws:// or wss://"),
        ("127.0.0.1", "has no port: give the router's --port (8000 by default), e.g. "
         "127.0.0.1:8000"),
        ("router.lan:http", "the port must be a number from 1 to 65535"),
        ("router.lan:0", "the port must be a number from 1 to 65535"),
        ("router.lan:70000", "the port must be a number from 1 to 65535"),
        (":8000", "names no host"),
    ],
)  # fmt: skip
def test_a_router_url_that_cannot_work_is_refused_saying_what_to_fix(
    given_url: str, says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        router_ws_url(given_url)
    with pytest.raises(ValidationError, match=re.escape(says)):  # one of several, too
        WorkerSettings(router_url=f"r1:8000, {given_url}")


def test_host_port_means_wss_when_a_ca_is_given(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    settings = WorkerSettings(router_url="10.0.0.5:8000, ws://r2:8000, https://r3", tls_ca=ca)
    assert settings.ws_urls == (
        "wss://10.0.0.5:8000/ws/worker",
        "ws://r2:8000/ws/worker",  # a scheme given is kept
        "wss://r3/ws/worker",
    )
    assert settings.inferred_wss == ("10.0.0.5:8000",)
    assert WorkerSettings(router_url="10.0.0.5:8000").inferred_wss == ()
    assert router_ws_url("r:1", tls=True) == "wss://r:1/ws/worker"


def test_outbox_batches_chunks_but_keeps_order() -> None:
    box = Outbox()
    box.chunk(JobId("a"), "1")
    box.chunk(JobId("b"), "x")
    box.chunk(JobId("a"), "2")
    box.send(JobDone(job_id=JobId("a")))
    box.chunk(JobId("b"), "y")
    sent: list[str] = []

    async def send(frame: str) -> None:
        sent.append(frame)
        raise asyncio.CancelledError  # one round is enough

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(box.pump(send))
    out = frames([])
    assert out == []
    assert len(sent) == 1
    first = decode_worker_message(sent[0])
    assert first.type == "chunks"
    assert [(c.job_id, c.data) for c in first.items] == [("a", "1"), ("b", "x"), ("a", "2")]


class _Stream:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self):  # type: ignore[no-untyped-def]
        for p in self.pieces:
            yield p


def test_sse_parsing_across_reads() -> None:
    pieces = [b'data: {"a":1}\n\ndata: {"b"', b":2}\n\n: keep-alive\n\n", b"data: [DONE]\n\n"]

    async def collect() -> list[list[str]]:
        return [batch async for batch in sse_data(_Stream(pieces))]  # type: ignore[arg-type]

    assert asyncio.run(collect()) == [['{"a":1}'], ['{"b":2}'], ["[DONE]"]]


def test_backend_errors_are_readable() -> None:
    e = error_from_body(400, b'{"error":{"code":400,"message":"too long","type":"x"}}')
    assert (e.message, e.type, e.code) == ("too long", "x", 400)
    e = error_from_body(502, b"<html>bad gateway</html>")
    assert "502" in e.message and "bad gateway" in e.message


REFUSED = (
    b'{"error":{"code":400,"message":"request (631 tokens) exceeds the available context size '
    b'(512 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":631,'
    b'"n_ctx":512}}'
)


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        (400, REFUSED, 632),  # llama-server's own answer: the prompt's tokens and one
        (400, REFUSED.replace(b',"n_prompt_tokens":631', b""), 513),  # only the slot's
        (400, REFUSED.replace(b',"n_prompt_tokens":631,"n_ctx":512', b""), None),
        (400, b'{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}', None),
        (500, REFUSED, None),
        (400, b"not json", None),
        (400, b'{"error":"exceed_context_size_error"}', None),
    ],
)
def test_a_prompt_too_long_for_the_context_is_told_apart(
    status: int, raw: bytes, expected: int | None
) -> None:
    assert context_needed(status, raw) == expected


def test_a_shard_asked_of_a_worker_that_cannot_run_one_fails_with_the_reason() -> None:
    async def main() -> list[str]:
        outbox = Outbox()
        reason = "this worker cannot take part in split models: no GPU CUDA2"
        link = router_link("ws://127.0.0.1:1/ws/worker", no_shards=reason, outbox=outbox)
        start = ShardStart(
            deployment="split", role=ShardRole.STAGE, model="split", source="m", ctx_size=1024
        )
        link._handle(start)
        sent: list[str] = []

        async def send(frame: str) -> None:
            sent.append(frame)
            raise asyncio.CancelledError

        with pytest.raises(asyncio.CancelledError):
            await outbox.pump(send)
        return sent

    [frame] = asyncio.run(main())
    status = decode_worker_message(frame)
    assert isinstance(status, ShardStatus)
    assert status.state is ShardState.FAILED and status.deployment == "split"
    assert "no GPU CUDA2" in status.detail


def test_a_store_mount_needs_the_store(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="--model-store-mount is the folder of a"):
        WorkerSettings(model_store_mount=tmp_path)
    mounted = WorkerSettings(model_store="https://store.lan:8100", model_store_mount=tmp_path)
    assert mounted.model_store_mount == tmp_path


@pytest.mark.parametrize(
    ("router_url", "tls_ca", "base"),
    [
        ("127.0.0.1:8000", None, "http://127.0.0.1:8000"),
        ("https://r.example", None, "https://r.example"),
        ("r.lan:8000, other:8000", Path("ca.pem"), "https://r.lan:8000"),
        ("wss://r.example/shoal/ws/worker", None, "https://r.example/shoal"),
    ],
)
def test_a_split_model_in_the_routers_own_store_is_fetched_from_the_router(
    router_url: str, tls_ca: Path | None, base: str
) -> None:
    """``StoreFile.url`` None: the router's ``--storage``, reached at the first router's URL."""
    settings = WorkerSettings(router_url=router_url, tls_ca=tls_ca)
    own = StoreFile(url=None, id="m", sha256="0" * 64, size=1)
    assert store_base(settings, own) == base
    there = StoreFile(url="http://store:8001", id="m", sha256="0" * 64, size=1)
    assert store_base(settings, there) == "http://store:8001"
