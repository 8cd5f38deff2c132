"""A worker told the wrong thing about its router says so instead of retrying in silence: a
--router-url that cannot reach a router's worker socket is refused at start (exit 2, naming
what to fix), and a router asked for a WebSocket on another path closes it saying which path
workers use. Real worker and router processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cluster import Cluster, clean_env, wait_until

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("router_url", "says"),
    [
        # The `shoal up` banner's Endpoint line, pasted: it dialed ws://…/v1 and got 403s.
        ("http://127.0.0.1:8000/v1", "drop /v1: give http://127.0.0.1:8000"),
        # It dialed ws://htp://host:8000.
        ("htp://router.lan:8000", "has the unknown scheme 'htp': give ws:// or wss://"),
        # It dialed port 80.
        ("127.0.0.1", "has no port: give the router's --port (8000 by default)"),
        # One bad router of several is as bad.
        ("127.0.0.1:8000,127.0.0.1", "'127.0.0.1' has no port"),
    ],
)
def test_a_router_url_that_cannot_work_stops_the_worker_at_start(
    router_url: str, says: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shoal", "worker", "--router-url", router_url, "--name", "w"],
        capture_output=True,
        text=True,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        timeout=60,  # before, it dialed on forever
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "shoal: error: invalid option: router_url:" in done.stderr
    assert says in done.stderr
    assert "Traceback" not in done.stderr


def test_a_websocket_to_another_path_is_closed_naming_the_workers_path(cluster: Cluster) -> None:
    """Before, the router answered 403 with no word of why, and a worker retried forever."""
    router = cluster.router()
    for _ in range(2):
        with (
            connect(f"ws://127.0.0.1:{router.port}/v1", open_timeout=10) as ws,
            pytest.raises(ConnectionClosed) as closed,
        ):
            ws.recv(timeout=10)
        close = closed.value.rcvd
        assert close is not None and close.code == 1008
        assert "no worker socket at /v1: workers dial /ws/worker" in close.reason
    log = router.proc.log()
    assert log.count("a WebSocket to /v1 from") == 1, log[-3000:]  # once, not per attempt
    assert "workers dial /ws/worker" in log


def test_a_worker_told_why_the_router_closed_says_it_once_per_line(cluster: Cluster) -> None:
    """A path behind a proxy prefix (allowed) that the router does not serve: the worker's
    retries name the router's reason once per line (websockets' own text says it twice), and
    its warning says what to check."""
    router = cluster.router()
    url = f"ws://127.0.0.1:{router.port}/proxied/ws/worker"
    worker = cluster.worker(router, "--router-url", url, model=False)
    reason = "no worker socket at /proxied/ws/worker"
    warned = "has not joined a router after 3 attempts"
    wait_until(lambda: warned in worker.log() or not worker.alive(), 90, "the worker's warning")
    log = worker.log()
    assert worker.alive(), log[-3000:]  # it goes on retrying: the router may be fixed
    lines = [line for line in log.splitlines() if reason in line]
    assert len(lines) >= 3, log[-3000:]  # every retry and the warning
    assert all(line.count(reason) == 1 for line in lines), lines
    assert f"the router closed the connection (1008: {reason}" in log
