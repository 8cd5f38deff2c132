"""How a worker chooses, holds and frees its model: the router's default, idle unload, and
air-gapped operation. Real router, worker and llama-server processes on loopback."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import openai
import psutil
import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, wait_until

pytestmark = pytest.mark.e2e


def _ask(router_url: str, model: str) -> str:
    with openai.OpenAI(base_url=router_url + "/v1", api_key=API_KEY, max_retries=0) as client:
        r = client.chat.completions.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert r.model == model
    return r.choices[0].message.content or ""


def _model_entry(router_url: str, model: str) -> dict[str, object]:
    r = http_calls.get(
        f"{router_url}/v1/models/{model}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    r.raise_for_status()
    entry: dict[str, object] = r.json()
    return entry


def test_idle_worker_unloads_and_loads_again_on_the_next_job(cluster: Cluster) -> None:
    router = cluster.router()
    worker = cluster.worker(router, "--idle-unload", "2")
    router.wait_workers(1)
    assert _model_entry(router.url, MODEL)["state"] == "ready"

    def ours() -> set[int]:
        """The worker's llama-server processes."""
        children = psutil.Process(worker.pid).children(recursive=True)
        return {c.pid for c in children if c.name() == "llama-server"}

    loaded = ours()
    assert loaded, "llama-server should be running while loaded"

    wait_until(
        lambda: router.workers()[0]["state"] == "unloaded", 30, "the worker to unload when idle"
    )
    wait_until(lambda: not (loaded & ours()), 15, "llama-server to exit after the idle unload")
    entry = _model_entry(router.url, MODEL)
    assert entry["state"] == "unloaded" and entry["workers_by_state"] == {"unloaded": 1}

    assert _ask(router.url, MODEL), "the job that arrives while unloaded waits and is served"
    assert router.workers()[0]["state"] == "ready" and ours() - loaded, "a new llama-server"
    log = worker.log()
    assert "ready -> unloaded" in log and "a job arrived; loading again" in log


def test_worker_without_model_serves_the_routers_default(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    os.link(model_path, store / "House-Default.gguf")
    router = cluster.router("--storage", str(store), "--default-model", "house-default")
    worker = cluster.worker(
        router,
        *("--model-store", router.url, "--llama-server-path", str(cluster.llama_server)),
        model=False,
    )
    router.wait_workers(1)
    [info] = router.workers()
    assert [m["name"] for m in info["models"]] == ["house-default"]
    assert "serving the router's default model house-default" in worker.log()
    # A request that names no model gets the router's default, served by that worker.
    r = http_calls.post(
        router.url + "/v1/chat/completions",
        headers=router.headers,
        json={"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["model"] == "house-default"
    assert _model_entry(router.url, "house-default")["state"] == "ready"


def _connects(trace: str) -> list[dict[str, str | None]]:
    """Every connect() in an strace log: address family, address, port, socket path."""
    calls = []
    for line in trace.splitlines():
        if "connect(" not in line:
            continue
        family = re.search(r"sa_family=(AF_\w+)", line)
        port = re.search(r"sin6?_port=htons\((\d+)\)", line)
        addr = re.search(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6?, "([^"]+)"', line)
        path = re.search(r'sun_path="([^"]*)"', line)
        calls.append(
            {
                "line": line,
                "family": family.group(1) if family else None,
                "port": port.group(1) if port else None,
                "addr": (addr.group(1) or addr.group(2)) if addr else None,
                "path": path.group(1) if path else None,
            }
        )
    return calls


def test_air_gapped_worker_makes_no_request_but_to_its_router(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With --model-path and --llama-server-path, every connect() the worker and its
    llama-server make (recorded by strace, children included) goes to the router or to that
    llama-server on loopback: no DNS, no Hugging Face, no GitHub."""
    strace = shutil.which("strace")
    assert strace, "strace is installed by scripts/dev.sh for this test"
    trace = tmp_path / "connect.trace"
    router = cluster.router()
    worker = cluster.worker(
        router,
        *("--model-path", str(cluster.model_path), "--model", MODEL),
        *("--llama-server-path", str(cluster.llama_server)),
        model=False,
        env={"HF_ENDPOINT": "http://192.0.2.1:9"},  # where a download would go; nothing there
        wrap=[strace, "-f", "-qq", "-e", "trace=connect", "-e", "signal=none", "-o", str(trace)],
    )
    router.wait_workers(1)
    assert _ask(router.url, MODEL)
    # Stop the worker itself (strace's child): strace exits when its tracees have.
    [shoal_worker] = psutil.Process(worker.pid).children()
    shoal_worker.terminate()
    assert worker.wait(30) == 0
    calls = _connects(trace.read_text())
    inet = [c for c in calls if c["family"] in ("AF_INET", "AF_INET6")]
    assert all(c["addr"] and c["port"] for c in inet), [c["line"] for c in inet]
    addresses = [(str(c["addr"]), int(str(c["port"]))) for c in inet]
    assert ("127.0.0.1", router.port) in addresses, "strace must have seen the router link"
    assert all(addr in ("127.0.0.1", "::1") for addr, _ in addresses), addresses
    backend_ports = {port for _, port in addresses} - {router.port}
    assert backend_ports, "the worker should have talked to its llama-server"
    for port in backend_ports:  # the llama-server the worker started: its log names the port
        assert f"--port {port} " in worker.log(), (port, addresses)
    unix = {c["path"] for c in calls if c["family"] == "AF_UNIX"}
    assert not {p for p in unix if p and ("nscd" in p or "resolve" in p)}, f"a lookup: {unix}"
    others = {c["family"] for c in calls} - {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert others <= {"AF_NETLINK", "AF_UNSPEC"}, [c["line"] for c in calls]
