"""The router's metrics: what the hot-path calls record, what a scrape shows, GET /metrics."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
from fastapi import FastAPI
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from pydantic import SecretStr
from starlette.types import ASGIApp

from shoal.router import errors
from shoal.router.admission.auth import KeyCheck
from shoal.router.admission.usage import cached_of, usage_of
from shoal.router.observe import metrics as metrics_module
from shoal.router.observe.metrics import (
    INTER_TOKEN_BUCKETS,
    TTFT_BUCKETS,
    UNMATCHED_ROUTE,
    WORKER_STATES,
    LoopHistogram,
    Metrics,
    RequestMetrics,
    Snapshot,
)
from shoal.router.routes import metrics as metrics_route

KEY = "sk-metrics-test"


def scrape(metrics: Metrics) -> list[Sample]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return [s for family in text_string_to_metric_families(body.decode()) for s in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def label_sets(samples: list[Sample], name: str) -> set[frozenset[str]]:
    return {frozenset(s.labels) for s in samples if s.name == name}


def buckets(samples: list[Sample], name: str, **labels: str) -> dict[float, float]:
    """``le`` bound -> cumulative count of one histogram series."""
    return {
        float(s.labels["le"]): s.value
        for s in samples
        if s.name == f"{name}_bucket" and {k: v for k, v in s.labels.items() if k != "le"} == labels
    }


def empty() -> Snapshot:
    return Snapshot()


# ------------------------------------------------------------------ events


def test_every_metric_in_the_issue_has_its_labels() -> None:
    m = Metrics(empty)
    m.request_finished("/v1/chat/completions", 200, 0.4)
    m.request_finished("/v1/chat/completions", 429, 0.001)
    m.first_token("smol", 0.2)
    m.inter_token("smol", 0.02)
    m.tokens("smol", 30, 12)
    m.queue_wait("smol", "key_a", 0.5)
    m.job_finished("smol", "succeeded")
    samples = scrape(m)

    route = {"route": "/v1/chat/completions"}
    assert value(samples, "shoal_requests_total", status="200", **route) == 1
    assert value(samples, "shoal_requests_total", status="429", **route) == 1
    assert value(samples, "shoal_request_duration_seconds_count", **route) == 2
    assert value(samples, "shoal_request_duration_seconds_sum", **route) == pytest.approx(0.401)
    assert value(samples, "shoal_time_to_first_token_seconds_count", model="smol") == 1
    assert value(samples, "shoal_time_to_first_token_seconds_sum", model="smol") == 0.2
    assert value(samples, "shoal_inter_token_seconds_count", model="smol") == 1
    assert value(samples, "shoal_tokens_total", model="smol", direction="in") == 30
    assert value(samples, "shoal_tokens_total", model="smol", direction="out") == 12
    assert value(samples, "shoal_queue_wait_seconds_count", model="smol") == 1
    assert value(samples, "shoal_jobs_total", model="smol", outcome="succeeded") == 1
    for gauge, labels in [
        ("shoal_workers", {"state"}),
        ("shoal_queue_depth", set()),  # empty snapshot: no series, but the family exists
        ("shoal_ready_slots", set()),
        ("shoal_deployment_shards", set()),
    ]:
        found = label_sets(samples, gauge)
        assert found <= {frozenset(labels)}, (gauge, found)
    body = m.render()[0].decode()
    for family in ("shoal_queue_depth", "shoal_ready_slots", "shoal_deployment_shards"):
        assert f"# TYPE {family} gauge" in body


def test_per_key_queue_metrics_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "MAX_KEY_LABELS", 2)
    depth = {"key_a": 3, "key_b": 1, "key_c": 2, "anonymous": 1}
    m = Metrics(lambda: Snapshot(key_queue_depth=depth))
    for key in ("key_a", "key_b", "key_c", "key_a"):
        m.queue_wait("smol", key, 0.25)
    samples = scrape(m)
    assert value(samples, "shoal_key_queue_wait_seconds_count", key="key_a") == 2
    assert value(samples, "shoal_key_queue_wait_seconds_count", key="key_b") == 1
    assert value(samples, "shoal_key_queue_wait_seconds_count", key="other") == 1  # key_c
    gauges = {s.labels["key"]: s.value for s in samples if s.name == "shoal_key_queue_depth"}
    assert gauges == {"key_a": 3, "key_c": 2, "other": 2}  # the two deepest, the rest summed


def test_counters_add_up() -> None:
    m = Metrics(empty)
    for _ in range(3):
        m.tokens("a", 10, 4)
        m.job_finished("a", "cancelled")
    m.tokens("b", 1, 0)
    samples = scrape(m)
    assert value(samples, "shoal_tokens_total", model="a", direction="in") == 30
    assert value(samples, "shoal_tokens_total", model="a", direction="out") == 12
    assert value(samples, "shoal_tokens_total", model="b", direction="out") == 0
    assert value(samples, "shoal_jobs_total", model="a", outcome="cancelled") == 3


def test_ttft_and_inter_token_buckets_span_llm_latencies() -> None:
    assert TTFT_BUCKETS[0] == 0.005 and TTFT_BUCKETS[-1] == 60.0
    assert INTER_TOKEN_BUCKETS[0] == 0.001 and INTER_TOKEN_BUCKETS[-1] == 2.0
    for bounds in (TTFT_BUCKETS, INTER_TOKEN_BUCKETS):
        assert list(bounds) == sorted(set(bounds))
    m = Metrics(empty)
    m.first_token("smol", 0.07)
    m.inter_token("smol", 0.0)  # chunks that arrived in one frame
    m.inter_token("smol", 0.001)  # on a bound: "le" includes it
    m.inter_token("smol", 0.012)
    m.inter_token("smol", 3.0)  # beyond the last bound: +Inf only
    samples = scrape(m)

    ttft = buckets(samples, "shoal_time_to_first_token_seconds", model="smol")
    assert sorted(ttft) == [*TTFT_BUCKETS, math.inf]
    assert ttft[0.05] == 0 and ttft[0.1] == 1 and ttft[math.inf] == 1

    itl = buckets(samples, "shoal_inter_token_seconds", model="smol")
    assert sorted(itl) == [*INTER_TOKEN_BUCKETS, math.inf]
    assert itl[0.001] == 2
    assert itl[0.01] == 2
    assert itl[0.015] == 3
    assert itl[2.0] == 3
    assert itl[math.inf] == 4
    assert value(samples, "shoal_inter_token_seconds_count", model="smol") == 4
    assert value(samples, "shoal_inter_token_seconds_sum", model="smol") == pytest.approx(3.013)


@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), max_size=60))
def test_loop_histogram_counts_like_prometheus_client(amounts: list[float]) -> None:
    reference = Histogram("ref", "r", ["model"], buckets=INTER_TOKEN_BUCKETS, registry=None)
    ours = LoopHistogram("ours", "o", "model", INTER_TOKEN_BUCKETS)
    for amount in amounts:
        reference.labels("m").observe(amount)
        ours.observe("m", amount)
    expected = {
        s.labels["le"]: s.value for s in next(iter(reference.collect())).samples if "le" in s.labels
    }
    got = {s.labels["le"]: s.value for s in ours.family().samples if "le" in s.labels}
    assert got == expected


@pytest.mark.parametrize("bounds", [(), (0.1, 0.1), (0.1, math.inf)])
def test_loop_histogram_refuses_bad_bounds(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="bucket bounds"):
        LoopHistogram("h", "h", "model", bounds)


# ------------------------------------------------------------------ state at scrape time


def test_gauges_reflect_the_snapshot_of_each_scrape() -> None:
    current = [Snapshot()]
    m = Metrics(lambda: current[0])
    samples = scrape(m)
    assert {s.labels["state"] for s in samples if s.name == "shoal_workers"} == set(WORKER_STATES)
    assert all(s.value == 0 for s in samples if s.name == "shoal_workers")

    current[0] = Snapshot(
        queue_depth={"smol": 4, "big": 0},
        workers={"ready": 2, "loading": 1},
        ready_slots={"smol": 3, "big": 0},
        shards={"llama-70b": {"running": 2, "loading": 1}},
    )
    samples = scrape(m)
    assert value(samples, "shoal_queue_depth", model="smol") == 4
    assert value(samples, "shoal_queue_depth", model="big") == 0
    assert value(samples, "shoal_workers", state="ready") == 2
    assert value(samples, "shoal_workers", state="loading") == 1
    assert value(samples, "shoal_workers", state="failed") == 0
    assert value(samples, "shoal_ready_slots", model="smol") == 3
    assert value(samples, "shoal_ready_slots", model="big") == 0
    assert value(samples, "shoal_deployment_shards", deployment="llama-70b", state="running") == 2
    assert value(samples, "shoal_deployment_shards", deployment="llama-70b", state="loading") == 1

    current[0] = Snapshot(workers={"ready": 1})
    samples = scrape(m)
    assert value(samples, "shoal_workers", state="ready") == 1
    assert label_sets(samples, "shoal_queue_depth") == set()  # nothing kept from last time


def test_two_instances_share_nothing() -> None:
    one = Metrics(lambda: Snapshot(queue_depth={"smol": 1}))
    two = Metrics(empty)
    assert one.registry is not two.registry
    one.request_finished("/health", 200, 0.01)
    one.inter_token("smol", 0.02)
    one.tokens("smol", 5, 5)
    samples = scrape(two)
    for name in (
        "shoal_requests_total",
        "shoal_inter_token_seconds_count",
        "shoal_tokens_total",
        "shoal_queue_depth",
    ):
        assert not [s for s in samples if s.name == name], name
    assert value(scrape(one), "shoal_requests_total", route="/health", status="200") == 1


# ------------------------------------------------------------------ usage in bodies


def _chat_result(content: str, usage: dict[str, object] | None) -> str:
    body: dict[str, object] = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
    }
    if usage is not None:
        body["usage"] = usage
    return orjson.dumps(body).decode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            _chat_result("hi", {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}),
            (9, 2),
        ),
        (
            _chat_result(
                "hi",
                {
                    "completion_tokens": 5,
                    "prompt_tokens": 7,
                    "total_tokens": 12,
                    "prompt_tokens_details": {"cached_tokens": 3},
                    "completion_tokens_details": {"reasoning_tokens": 0},
                },
            ),
            (7, 5),
        ),
        # A model that writes "usage": {...} in its answer: escaped inside the string.
        (
            _chat_result(
                '"usage": {"prompt_tokens": 99}', {"prompt_tokens": 1, "completion_tokens": 1}
            ),
            (1, 1),
        ),
        (_chat_result("usage", None), None),
        (_chat_result("no counts", None), None),
        (_chat_result("x", {"prompt_tokens": "9", "completion_tokens": 2}), None),
        (_chat_result("x", {"prompt_tokens": True, "completion_tokens": 2}), None),
        (_chat_result("x", {"prompt_tokens": -1, "completion_tokens": 2}), None),
        ('{"object":"list","data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}', (4, 0)),
        ('{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":8}}', (3, 8)),
        ('{"usage": null}', None),
        ("", None),
    ],
)
def test_usage_of(body: str, expected: tuple[int, int] | None) -> None:
    assert usage_of(body) == expected


def test_usage_key_before_a_later_string_value_usage() -> None:
    body = '{"usage":{"prompt_tokens":2,"completion_tokens":3},"choices":[{"text":"usage"}]}'
    assert usage_of(body) == (2, 3)


# ------------------------------------------------------------------ GET /metrics


def metrics_app(metrics: Metrics | None, auth: KeyCheck | None) -> FastAPI:
    app = FastAPI()
    errors.install(app)
    app.include_router(metrics_route.router)
    if metrics is not None:
        app.state.metrics = metrics
    if auth is not None:
        app.state.metrics_auth = auth.admin
    return app


@asynccontextmanager
async def client_of(
    app: ASGIApp, raise_app_exceptions: bool = True
) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        yield client


async def test_route_needs_the_key_and_serves_the_exposition() -> None:
    m = Metrics(lambda: Snapshot(queue_depth={"smol": 2}))
    m.first_token("smol", 0.3)
    app = metrics_app(m, KeyCheck(api_keys=(), gpu_keys=(), admin_keys=(SecretStr(KEY),)))
    async with client_of(app) as client:
        refused = await client.get("/metrics")
        wrong = await client.get("/metrics", headers={"Authorization": "Bearer nope"})
        ok = await client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert wrong.status_code == 401
    assert ok.status_code == 200
    assert ok.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = [s for f in text_string_to_metric_families(ok.text) for s in f.samples]
    assert value(samples, "shoal_queue_depth", model="smol") == 2
    assert value(samples, "shoal_time_to_first_token_seconds_count", model="smol") == 1


async def test_route_open_when_no_key_is_configured() -> None:
    app = metrics_app(Metrics(empty), KeyCheck(api_keys=(), gpu_keys=()))
    async with client_of(app) as client:
        answer = await client.get("/metrics")
    assert answer.status_code == 200
    assert "# TYPE shoal_workers gauge" in answer.text


async def test_route_without_metrics_installed_says_what_is_missing() -> None:
    app = metrics_app(None, KeyCheck(api_keys=(), gpu_keys=()))
    async with client_of(app) as client:
        with pytest.raises(metrics_route.MetricsNotInstalled, match=r"app\.state\.metrics"):
            await client.get("/metrics")


# ------------------------------------------------------------------ requests outside the fast path


def counted_app() -> tuple[ASGIApp, Metrics]:
    inner = FastAPI()

    @inner.get("/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    @inner.get("/broken")
    async def broken() -> None:
        raise RuntimeError("a bug")

    m = Metrics(empty)
    return RequestMetrics(inner, m), m


def request_samples(m: Metrics) -> Iterator[Sample]:
    return (s for s in scrape(m) if s.name == "shoal_requests_total")


async def test_request_metrics_label_by_route_template_and_status() -> None:
    app, m = counted_app()
    async with client_of(app, raise_app_exceptions=False) as client:
        for thing in ("a", "b", "c"):
            assert (await client.get(f"/things/{thing}")).status_code == 200
        assert (await client.get("/no/such/path")).status_code == 404
        assert (await client.get("/things/a", params={"x": "1"})).status_code == 200
        assert (await client.get("/broken")).status_code == 500
    samples = list(request_samples(m))
    assert {(s.labels["route"], s.labels["status"]): s.value for s in samples} == {
        ("/things/{thing_id}", "200"): 4,
        (UNMATCHED_ROUTE, "404"): 1,
        ("/broken", "500"): 1,
    }
    all_samples = scrape(m)
    assert (
        value(all_samples, "shoal_request_duration_seconds_count", route="/things/{thing_id}") == 4
    )


def test_tunnel_bytes_are_a_counter_per_deployment_and_direction() -> None:
    m = Metrics(lambda: Snapshot(tunnel_bytes={"big": (123_456, 789)}))
    samples = scrape(m)
    assert value(samples, "shoal_tunnel_bytes_total", deployment="big", direction="to_stages") == (
        123_456
    )
    assert value(samples, "shoal_tunnel_bytes_total", deployment="big", direction="to_head") == 789
    assert "# TYPE shoal_tunnel_bytes_total counter" in m.render()[0].decode()


def test_prompt_tokens_computed_and_cached_per_model() -> None:
    m = Metrics(empty)
    m.prompt_cache("smol", 900, 1000)
    m.prompt_cache("smol", 0, 50)
    samples = scrape(m)
    assert value(samples, "shoal_prompt_tokens_total", model="smol", source="cached") == 900
    assert value(samples, "shoal_prompt_tokens_total", model="smol", source="computed") == 150


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":7}}}', 7),
        ('{"choices":[],"timings":{"cache_n":5,"prompt_n":2,"predicted_n":1}}', 5),
        (  # usage wins over timings, wherever each is
            '{"timings":{"cache_n":5},"usage":{"prompt_tokens":9,'
            '"prompt_tokens_details":{"cached_tokens":8}}}',
            8,
        ),
        ('{"usage":{"prompt_tokens":9,"completion_tokens":1}}', None),  # says nothing of it
        ('{"content":"\\"cached_tokens\\": 3"}', None),  # only inside a string
    ],
)
def test_cached_of(body: str, expected: int | None) -> None:
    assert cached_of(body) == expected
