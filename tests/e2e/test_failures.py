"""What happens when parts die: llama-server, a worker mid-stream, the router."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import openai
import pytest

import http_calls
from cluster import API_KEY, MODEL, STARTUP_TIMEOUT_S, Cluster, free_port, wait_until
from shoal.worker.link.router_link import NEVER_REACHED_WARN_AFTER

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Say hello."}]
Client = Callable[..., openai.OpenAI]


def test_killed_llama_server_restarts_and_serves(cluster: Cluster, make_client: Client) -> None:
    router = cluster.router()
    cluster.worker(router)
    [worker] = router.wait_workers(1)
    pid = int(worker["detail"].rsplit("pid ", 1)[1].rstrip(")"))
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: router.workers()[0]["state"] != "ready", 15, "the worker to notice")
    [worker] = router.wait_workers(1)
    assert f"pid {pid})" not in worker["detail"]
    r = make_client(router.url).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert r.choices[0].message.content


def test_worker_killed_mid_stream_ends_stream_with_error(
    cluster: Cluster, make_client: Client
) -> None:
    router = cluster.router()
    worker = cluster.worker(router)
    router.wait_workers(1)
    stream = make_client(router.url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=1000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="worker serving this request was lost"):
        for _ in stream:
            got += 1
            if got == 3:
                os.kill(worker.pid, signal.SIGKILL)
    assert got >= 3
    assert time.monotonic() - t0 < 10


def test_worker_lost_before_first_token_requeues(cluster: Cluster) -> None:
    """The job's worker dies while llama-server is still reading the prompt: another serves it."""
    router = cluster.router("--max-wait", "60")
    doomed = cluster.worker(router, "--slots", "1", name="doomed")
    [doomed_info] = router.wait_workers(1)
    long_prompt = "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 250
    answer: dict[str, object] = {}

    def ask() -> None:
        with http_calls.stream(
            "POST",
            router.url + "/v1/chat/completions",
            timeout=120,
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={
                "model": MODEL,
                "stream": True,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": long_prompt}],
            },
        ) as r:
            answer["status"] = r.status_code
            answer["worker"] = r.headers.get("x-shoal-worker")
            answer["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    client = threading.Thread(target=ask)
    client.start()
    wait_until(lambda: router.workers()[0]["running_jobs"] == 1, 10, "the job to be assigned")
    os.kill(doomed.pid, signal.SIGKILL)  # ~1,500 prompt tokens: no token has been produced yet
    cluster.worker(router, name="rescuer")
    client.join(90)
    assert answer["status"] == 200, cluster.logs()
    assert answer["worker"] != doomed_info["id"]
    assert str(answer["worker"]).startswith("rescuer-")
    lines = answer["lines"]
    assert isinstance(lines, list) and lines[-1] == "data: [DONE]"
    assert "re-queued" in cluster.procs[0].log()


def test_router_restart_worker_reconnects(cluster: Cluster, make_client: Client) -> None:
    router = cluster.router()
    cluster.worker(router)
    router.wait_workers(1)
    assert router.proc.stop() is not None
    router2 = cluster.router(port=router.port)
    router2.wait_workers(1, timeout=30)
    r = make_client(router2.url).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert r.choices[0].message.content


def test_a_worker_that_never_reaches_its_router_warns_once(cluster: Cluster) -> None:
    """Wrong port: the retries are INFO lines; after a few, one WARNING names the URL dialed
    and what to check, and the worker goes on retrying."""
    router = cluster.router()
    wrong = f"127.0.0.1:{free_port()}"  # nothing listens there
    worker = cluster.worker(router, "--router-url", wrong, model=False)
    wait_until(
        lambda: worker.log().count("reconnecting in") >= NEVER_REACHED_WARN_AFTER + 2,
        STARTUP_TIMEOUT_S,
        "the worker to retry past its warning",
    )
    log = worker.log()
    warnings = [line for line in log.splitlines() if "has not joined a router" in line]
    assert len(warnings) == 1, log
    (warning,) = warnings
    assert "WARNING" in warning and f"after {NEVER_REACHED_WARN_AFTER} attempts" in warning
    assert f"dialing ws://{wrong}/ws/worker" in warning and "Connection refused" in warning
    # What to check for a refused connection: the router's address, not TLS or a firewall.
    assert "Nothing accepts connections there" in warning and "--port" in warning
    retries = [line for line in log.splitlines() if "reconnecting in" in line]
    assert all(" INFO " in line for line in retries)
    assert worker.alive() and router.workers() == []


def test_health_is_open_and_reports_workers(cluster: Cluster) -> None:
    router = cluster.router()
    body = http_calls.get(router.url + "/health").json()
    assert body["status"] == "no_ready_workers" and body["workers"] == 0
    cluster.worker(router)
    router.wait_workers(1)
    body = http_calls.get(router.url + "/health").json()
    assert body["status"] == "ok" and body["models"] == [MODEL]
