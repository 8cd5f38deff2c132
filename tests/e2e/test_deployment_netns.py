"""A split model across network namespaces: traffic crosses real interfaces, as between hosts.

The router runs in the root namespace on a bridge address; the head and the two stages each
run in a namespace of their own, joined to the bridge by a veth pair, and dial the router at
its bridge address. In the default (relayed) mode every byte of RPC goes through the router's
tunnel listener: a stage's ``ggml-rpc-server`` listens on its namespace's 127.0.0.1 only and
cannot be reached from the head's namespace at all.
"""

from __future__ import annotations

import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import http_calls
from cluster import API_KEY, MODEL, Cluster, wait_until

pytestmark = pytest.mark.e2e

ADMIN = API_KEY  # also the control-plane key: the router listens beyond loopback


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class Net:
    bridge_ip: str
    namespaces: dict[str, str]  # name -> its address
    veths: dict[str, str]  # name -> its bridge-side interface

    def wrap(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", name]

    def rx_bytes(self, name: str) -> int:
        """Bytes the namespace sent out through its veth (received on the bridge side)."""
        return int(Path(f"/sys/class/net/{self.veths[name]}/statistics/rx_bytes").read_text())

    def tx_bytes(self, name: str) -> int:
        return int(Path(f"/sys/class/net/{self.veths[name]}/statistics/tx_bytes").read_text())


@pytest.fixture
def net() -> Iterator[Net]:
    tag = uuid.uuid4().hex[:5]
    subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    bridge = f"shbr{tag}"
    names = {role: f"sh{tag}{role}" for role in ("h", "s1", "s2")}
    created: list[str] = []
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        addresses, veths = {}, {}
        for i, name in enumerate(names.values(), start=2):
            sh("ip", "netns", "add", name)
            created.append(name)
            outside, inside = f"v{tag}{i}o", f"v{tag}{i}i"
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", name)
            sh("ip", "link", "set", outside, "master", bridge)
            sh("ip", "link", "set", outside, "up")
            sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{subnet}.{i}/24", "dev", inside)
            sh("ip", "netns", "exec", name, "ip", "link", "set", inside, "up")
            sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            addresses[name], veths[name] = f"{subnet}.{i}", outside
        yield Net(f"{subnet}.1", addresses, veths)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"cannot build the namespaces (needs root and iproute2): {exc.stderr!r}")
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)


def test_split_over_namespaces_goes_through_the_tunnel_only(cluster: Cluster, net: Net) -> None:
    router = cluster.router("--host", "0.0.0.0", "--admin-key", ADMIN)
    url = f"{net.bridge_ip}:{router.port}"
    names = list(net.namespaces)
    procs = {
        name: cluster.worker(
            router,
            *("--router-url", url, "--slots", "1", "--ctx-size", "1024"),
            name=name,
            wrap=net.wrap(name),
        )
        for name in names
    }
    router.wait_workers(3)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    sent_before = net.rx_bytes(names[1])
    body = {"model": str(cluster.model_path), "name": "split", "workers": names, "ctx": 1024}
    r = http_calls.post(
        router.url + "/api/v1/pipeline/deploy", json=body, headers=admin, timeout=30
    )
    assert r.status_code == 202, r.text

    def serving() -> dict[str, object] | None:
        r = http_calls.get(router.url + "/api/v1/pipeline/status", headers=admin, timeout=10)
        [d] = r.json()["data"]
        return d if d["state"] == "serving" else None

    deployed = wait_until(serving, 180, "the split to serve across namespaces")
    assert [s["worker_name"] for s in deployed["shards"]] == names

    def ask(model: str) -> str:
        prompt = {"role": "user", "content": "What is the capital of France?"}
        body = {"model": model, "messages": [prompt], "temperature": 0, "max_tokens": 32}
        r = http_calls.post(
            router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=120
        )
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    assert ask("split") == ask(MODEL)
    # The stage's tensors (tens of MiB) left the head's namespace through its veth and
    # reached the stage's through the router: real interfaces carried the RPC traffic.
    assert net.tx_bytes(names[1]) - sent_before > 10 * 2**20

    # A stage's RPC server listens on its own 127.0.0.1 only: unreachable from the head.
    [stage] = [
        p
        for p in psutil.Process(procs[names[1]].pid).children(recursive=True)
        if p.name() == "ggml-rpc-server"
    ]
    argv = stage.cmdline()  # psutil cannot list another namespace's sockets: read its -H/-p
    assert argv[argv.index("-H") + 1] == "127.0.0.1"
    port = int(argv[argv.index("-p") + 1])
    probe = (
        "import socket,sys\n"
        f"try:\n socket.create_connection(({net.namespaces[names[1]]!r}, {port}), timeout=3)\n"
        "except OSError:\n sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    reached = subprocess.run([*net.wrap(names[0]), sys.executable, "-c", probe], timeout=30)
    assert reached.returncode == 0, "the stage's RPC port answered from the head's namespace"
