"""Back-pressure: a full queue answers 429, a wait past the limit answers 503."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import openai
import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, Router, wait_until

pytestmark = pytest.mark.e2e

LONG = {
    "model": MODEL,
    "max_tokens": 400,
    "temperature": 0,
    "stream": True,
    "ignore_eos": True,  # llama-server option: hold the slot for all 400 tokens
    "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
}


def _hold_slot(url: str, started: threading.Event, stop: threading.Event) -> None:
    with http_calls.stream(
        "POST",
        url + "/v1/chat/completions",
        json=LONG,
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as r:
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


def _queued(router: Router) -> int:
    models = http_calls.get(router.url + "/v1/models", headers=router.headers).json()["data"]
    return int(models[0]["queued"])


def test_full_queue_is_429_and_long_wait_is_503(
    cluster: Cluster, make_client: Callable[..., openai.OpenAI]
) -> None:
    router = cluster.router("--max-queue", "1", "--max-wait", "1.5")
    cluster.worker(router, "--slots", "1")
    router.wait_workers(1)
    started, stop = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_slot, args=(router.url, started, stop))
    holder.start()
    try:
        assert started.wait(30), cluster.logs()
        client = make_client(router.url)
        results: list[BaseException] = []

        def waiter() -> None:
            try:
                client.chat.completions.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
                )
            except openai.APIStatusError as exc:
                results.append(exc)

        queued = threading.Thread(target=waiter)
        t0 = time.monotonic()
        queued.start()
        wait_until(lambda: _queued(router) == 1, 5, "the second request to queue")
        with pytest.raises(openai.RateLimitError) as full:
            client.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert full.value.response.headers["retry-after"].isdigit()
        assert full.value.code == "queue_full"
        queued.join(10)
        waited = time.monotonic() - t0
        assert len(results) == 1 and isinstance(results[0], openai.InternalServerError)
        assert results[0].status_code == 503
        assert results[0].response.headers["retry-after"].isdigit()
        assert "within 1.5 s" in str(results[0])
        assert 1.4 < waited < 5, waited
    finally:
        stop.set()
        holder.join(30)
