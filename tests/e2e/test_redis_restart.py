"""Redis restarted under a real router mid-job: every request still gets its whole answer.

A private redis-server (append-only file, fsync on every write; ``redis_server``), a real
router on it, a real worker with the real model and fewer slots than requests, so some
requests wait in the Redis queue while others stream. Redis is killed while answers are
being generated and started again on the same port a few seconds later.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import redis

from cluster import API_KEY, MODEL, Cluster, wait_until
from redis_server import OwnRedis, own_redis_server

pytestmark = pytest.mark.e2e

SLOTS = 2
STREAMED = 3
NOT_STREAMED = 3
OUTAGE_S = 2.5  # how long Redis stays down (the point of the test, not a wait for something)
MAX_TOKENS = 120
LEASE_S = 3  # the shortest lease: by the time Redis is back, every lease looks expired
PROMPT = [{"role": "user", "content": "Tell a long story about a fish."}]


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    with own_redis_server(tmp_path) as server:
        yield server


@dataclass
class Answer:
    """What one client saw: the router's request id, the text, why it ended, or an error."""

    stream: bool
    request_id: str = ""
    content: str = ""
    finish_reason: str | None = None
    error: str = ""
    first_output: threading.Event = field(default_factory=threading.Event)


def ask(client: openai.OpenAI, answer: Answer) -> None:
    try:
        if answer.stream:
            _ask_streamed(client, answer)
        else:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, extra_body=_LONG
            )
            answer.request_id = raw.headers.get("x-request-id", "")
            choice = raw.parse().choices[0]
            answer.content = choice.message.content or ""
            answer.finish_reason = choice.finish_reason
    except openai.OpenAIError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"


_LONG = {"ignore_eos": True}  # every answer is MAX_TOKENS long: still running when Redis goes


def _ask_streamed(client: openai.OpenAI, answer: Answer) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, stream=True, extra_body=_LONG
    )
    answer.request_id = raw.headers.get("x-request-id", "")
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            answer.content += choice.delta.content
            answer.first_output.set()
        if choice.finish_reason:
            answer.finish_reason = choice.finish_reason


def test_requests_complete_when_redis_restarts_mid_answer(
    cluster: Cluster, own_redis: OwnRedis, make_client: openai.OpenAI
) -> None:
    prefix = f"shoal-restart-{uuid.uuid4().hex[:8]}:"
    router = cluster.router(
        "--redis-url", own_redis.url, "--redis-prefix", prefix, "--queue-lease", str(LEASE_S)
    )
    cluster.worker(router, "--slots", str(SLOTS), name="steady")
    router.wait_workers(1)
    client = make_client(router.url, API_KEY)
    answers = [Answer(stream=True) for _ in range(STREAMED)]
    answers += [Answer(stream=False) for _ in range(NOT_STREAMED)]
    threads = [threading.Thread(target=ask, args=(client, a)) for a in answers]
    for t in threads:
        t.start()
    try:
        wait_until(
            lambda: any(a.first_output.is_set() for a in answers), 60, "a streamed answer to start"
        )
        down_at = time.monotonic()
        own_redis.stop(signal.SIGKILL)
        running = [a for a in answers if a.first_output.is_set()]
        time.sleep(OUTAGE_S)
        own_redis.start()
        back_at = time.monotonic()
    finally:
        for t in threads:
            t.join(120)
    log = router.proc.log()
    failed = [a for a in answers if a.error or not a.content or a.finish_reason is None]
    assert not failed, f"{failed}\n{cluster.logs()}"
    ids = [a.request_id for a in answers]
    assert all(ids) and len(set(ids)) == len(ids), ids
    # Some answers were mid-stream and some requests still queued when Redis went down.
    assert running and len(running) < len(answers)
    assert all(a.finish_reason == "length" for a in answers), answers
    # Each job ran once and ended once in Redis (kept through the restart by the AOF).
    client = redis.Redis(host="127.0.0.1", port=own_redis.port)
    try:
        for job_id in ids:
            job = client.hgetall(f"{prefix}job:{job_id}")
            assert job[b"state"] == b"succeeded" and job[b"attempt"] == b"1", (job_id, job)
            assert len(finals(client, prefix, job_id)) == 1, job_id
    finally:
        client.close()
    # The router logged the outage once and the recovery once.
    assert log.count("Redis unreachable") == 1, log[-5000:]
    assert log.count("Redis reachable again") == 1, log[-5000:]
    print(f"Redis down {back_at - down_at:.1f} s; router log:\n{log[-3000:]}")


def finals(client: redis.Redis, prefix: str, job_id: str) -> list[str]:
    """The final events (result/done/failed) in a job's output stream."""
    kinds = [json.loads(e[b"e"])["t"] for _, e in client.xrange(f"{prefix}job:{job_id}:out")]
    return [k for k in kinds if k in ("result", "done", "failed")]
