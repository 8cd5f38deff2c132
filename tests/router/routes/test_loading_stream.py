"""``JobLoading`` through a real router process and a stand-in worker speaking the real
protocol: a streamed answer shows ``: loading model=…`` before its first token (the official
``openai`` client passes over it and parses the answer); a non-streamed one just waits; a
failure after the comment still reaches the client, as its stream's error event. Each with
one router, and with two on one Redis (the client calls the one without the worker). The
worker's report of the load is scraped from ``/metrics`` (``shoal_model_*``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import API_KEY, GPU_KEY, Cluster, Router, wait_until
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from standin_worker import StandInWorker

A = ModelName("multi-a")
GB = 1 << 30


REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class Routers:
    front: Router
    """The router the client calls."""
    back: Router
    """The router the stand-in worker is connected to (with Redis, another one)."""


@pytest.fixture(params=["memory", "redis"])
def routers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Routers]:
    """Real router processes (no llama-server needed: the worker is a stand-in): one
    in-process; or two on one Redis, the client calling the one without the worker, so the
    load's event travels through the job's Redis output stream."""
    cluster = Cluster(tmp_path, Path("unused-llama-server"), Path("unused-model"))
    try:
        if request.param == "memory":
            router = cluster.router()
            yield Routers(router, router)
        else:
            prefix = request.getfixturevalue("redis_prefix")
            shared = ("--redis-url", REDIS_URL, "--redis-prefix", prefix)
            yield Routers(cluster.router(*shared), cluster.router(*shared))
    finally:
        cluster.stop_all()


@pytest.fixture
def router(routers: Routers) -> Router:
    return routers.front


@pytest.fixture
def standin(routers: Routers) -> Iterator[StandInWorker]:
    info = ModelInfo(
        name=A,
        endpoints=(Endpoint.CHAT,),
        state=BackendState.UNLOADED,
        slots=2,
        resident_bytes=2 * GB,
    )
    back = routers.back
    worker = StandInWorker(f"127.0.0.1:{back.port}", GPU_KEY, [info], budget=8 * GB)
    worker.start()
    back.wait_workers(1)
    routers.front.wait_workers(1)  # with Redis: once the directory lists it there too
    try:
        yield worker
    finally:
        worker.stop()


def _ask(text: str, stream: bool) -> dict[str, object]:
    return {"model": A, "messages": [{"role": "user", "content": text}], "stream": stream}


def _raw_stream(router: Router, text: str) -> str:
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            router.url + "/v1/chat/completions",
            json=_ask(text, True),
            headers=router.headers,
        ) as response,
    ):
        assert response.status_code == 200
        return "".join(response.iter_text())


def test_a_stream_shows_the_load_before_its_first_token(
    router: Router, standin: StandInWorker
) -> None:
    body = _raw_stream(router, "hi")
    assert body.startswith(f": loading model={A}\n\n"), body[:200]
    events = [e for e in body.split("\n\n") if e]
    assert events[0] == f": loading model={A}"
    data = [orjson.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"]["content"] for d in data) == "Hello there"
    assert events[-1] == "data: [DONE]"
    # resident now: the next stream has no such comment
    assert ": loading" not in _raw_stream(router, "again")


def test_the_workers_router_exposes_its_models_figures(
    routers: Routers, standin: StandInWorker
) -> None:
    """The worker's report of a load, scraped from /metrics of the router holding it."""
    _raw_stream(routers.front, "hi")
    router = routers.back
    metrics = httpx.get(router.url + "/metrics", headers=router.headers, timeout=10)
    assert metrics.status_code == 200, metrics.text
    series = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.text)
        for s in family.samples
        if s.name.startswith("shoal_model_") and s.labels == {"model": A, "worker": "standin"}
    }
    assert series == {
        "shoal_model_loads_total": 1,
        "shoal_model_evictions_total": 0,
        "shoal_model_load_seconds": 0.5,
        "shoal_model_resident_bytes": 2 * GB,
    }
    # /v1/models of the router the client calls says where it is resident (with Redis, from
    # the worker directory)
    front = routers.front

    def placements() -> list[dict[str, object]] | None:
        r = httpx.get(f"{front.url}/v1/models/{A}", headers=front.headers, timeout=10)
        found: list[dict[str, object]] = r.json()["placements"]
        return found if found and found[0]["residency"] == "resident" else None

    [placed] = wait_until(placements, 10, "the load in /v1/models")
    assert placed["worker"] == "standin" and placed["resident_bytes"] == 2 * GB
    assert placed["loads"] == 1 and placed["load_seconds"] == 0.5


def test_the_openai_client_passes_over_the_comment(
    router: Router, standin: StandInWorker, make_client: Callable[..., openai.OpenAI]
) -> None:
    client = make_client(router.url, API_KEY)
    stream = client.chat.completions.create(
        model=A, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Hello there"
    assert standin.models[A].state is BackendState.READY


def test_a_non_streamed_job_just_waits(
    router: Router, standin: StandInWorker, make_client: Callable[..., openai.OpenAI]
) -> None:
    reply = make_client(router.url, API_KEY).chat.completions.create(
        model=A, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content == "Hello there"


def test_a_failure_after_the_load_is_the_streams_error_event(
    router: Router, standin: StandInWorker, make_client: Callable[..., openai.OpenAI]
) -> None:
    body = _raw_stream(router, "please FAIL")
    events = [e for e in body.split("\n\n") if e]
    assert events[0] == f": loading model={A}"
    error = orjson.loads(events[-1].removeprefix("data: "))["error"]
    assert "the stand-in failed it" in error["message"]
    assert "[DONE]" not in body
    client = make_client(router.url, API_KEY)
    with pytest.raises(openai.APIError, match="the stand-in failed it"):
        for _ in client.chat.completions.create(
            model=A, messages=[{"role": "user", "content": "FAIL"}], stream=True
        ):
            pass
