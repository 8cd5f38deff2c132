"""Only workers with a GPU key and the same protocol join; a bad frame drops only its sender."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cluster import GPU_KEY, Cluster, Router
from shoal.protocol.messages import PROTOCOL_VERSION
from tcp_relay import holding_relay

pytestmark = pytest.mark.e2e


def _register(version: int = PROTOCOL_VERSION, worker_id: str = "raw-1") -> str:
    return json.dumps(
        {
            "type": "register",
            "protocol_version": version,
            "worker_id": worker_id,
            "name": "raw",
            "slots": 1,
            "state": "ready",
            "hardware": {
                "hostname": "h",
                "os": "linux",
                "cpu_count": 1,
                "ram_total_bytes": 1,
                "ram_available_bytes": 1,
            },
            "models": [{"name": "raw-model", "endpoints": ["chat"]}],
        }
    )


def _ws(router: Router, key: str | None = GPU_KEY):  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return connect(f"ws://127.0.0.1:{router.port}/ws/worker", additional_headers=headers)


def test_worker_with_bad_key_is_refused_and_exits(cluster: Cluster) -> None:
    router = cluster.router()
    worker = cluster.worker(router, gpu_key="wrong-key")
    assert worker.wait(60) == 2
    assert "GPU key is missing or wrong" in worker.log()
    assert router.workers() == []


def test_a_worker_refused_for_its_key_stops_at_once_saying_how_to_get_one(
    cluster: Cluster,
) -> None:
    """Also when the refusal reaches the worker with the handshake's answer, in one piece (a
    slow link): before, the worker found the connection closed when it sent its register,
    took that for a network failure, retried with advice about firewalls and TLS, and only
    stopped once a try happened to read the ``refused`` frame."""
    router = cluster.router()
    with holding_relay(router.port) as port:
        worker = cluster.worker(
            router, "--router-url", f"127.0.0.1:{port}", gpu_key="wrong-key", model=False
        )
        assert worker.wait(60) == 2, worker.log()[-3000:]
    log = worker.log()
    assert "refused this worker (bad_key)" in log, log[-3000:]
    assert "its key is not one of the router's" in log
    assert "`shoal keys create --scope worker`" in log
    assert "reconnecting" not in log and "firewall" not in log


def test_protocol_version_mismatch_is_refused(cluster: Cluster) -> None:
    router = cluster.router()
    with _ws(router) as ws:
        ws.send(_register(version=999))
        reply = json.loads(ws.recv(timeout=5))
        assert reply["type"] == "refused" and reply["code"] == "protocol_version"
        assert "speaks 999" in reply["reason"]
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001


def test_missing_key_is_refused(cluster: Cluster) -> None:
    router = cluster.router()
    with _ws(router, key=None) as ws:
        reply = json.loads(ws.recv(timeout=5))
        assert reply["code"] == "bad_key"


def test_malformed_frame_closes_only_that_connection(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker(router, name="good")
    router.wait_workers(1)
    with _ws(router) as ws:
        ws.send(_register())
        assert json.loads(ws.recv(timeout=5))["type"] == "registered"
        assert {w["name"] for w in router.workers()} == {"good", "raw"}
        ws.send("{this is not json")
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4002
    assert [w["name"] for w in router.workers()] == ["good"]
    assert router.workers()[0]["state"] == "ready"
