"""Split models whose stages load their own layers: a deploy sends no weights through the router.

Real router, three real workers (a head and two stages, relayed mode: every RPC byte crosses
the router's tunnel) and a generated GGUF whose FFN tensors are over llama.cpp's 10 MiB hash
threshold (``big_gguf.py``). The same test deploys it twice: with the stages' RPC cache off
(``--rpc-cache-max 0``: the head sends every weight), then with it on (the stages pre-seed
their layers from their copy of the GGUF: the head sends only the small tensors). Then a
stage is killed and the redeploy sends no weights again. Greedy answers equal one machine's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from split_models import PROMPTS, ask, deployment, rpc_servers

import http_calls
from cluster import Cluster, Proc, Router, wait_until
from shoal.models.gguf_info import inspect
from shoal.models.stage_tensors import stage_tensors

pytestmark = pytest.mark.e2e

NAME = "big-split"
ONE_MACHINE = "big-one"


def _worker(cluster: Cluster, router: Router, name: str, gguf: Path, *args: str) -> Proc:
    return cluster.worker(
        router,
        "--llama-server-path",
        str(cluster.llama_server),
        "--model",
        str(gguf),
        "--model-alias",
        ONE_MACHINE if name == "h" else f"big-{name}",
        "--slots",
        "1",
        "--ctx-size",
        "512",
        *args,
        name=name,
        model=False,
    )


def _deploy(router: Router, gguf: Path) -> dict[str, object]:
    body = {
        "model": str(gguf),
        "name": NAME,
        "workers": ["h", "s1", "s2"],
        "ctx": 512,
        "strategy": "balanced",
        "mode": "relayed",
    }
    r = http_calls.post(
        router.url + "/api/v1/pipeline/deploy", json=body, headers=router.headers, timeout=30
    )
    assert r.status_code == 202, r.text
    return _serving(router)


def _serving(router: Router) -> dict[str, object]:
    served: dict[str, object] = wait_until(
        lambda: (d := deployment(router, NAME))["state"] == "serving" and d,
        120,
        "the split model to serve",
    )
    return served


def _sent(d: dict[str, object]) -> int:
    last = d["last_deploy"]
    assert isinstance(last, dict)
    sent: int = last["tunnel_bytes"]["to_stages"]
    return sent


def test_preseeded_stages_get_no_weights_through_the_tunnel(
    cluster: Cluster, big_gguf: Path
) -> None:
    router = cluster.router()
    _worker(cluster, router, "h", big_gguf)
    cold_stages = [
        _worker(cluster, router, name, big_gguf, "--rpc-cache-max", "0") for name in ("s1", "s2")
    ]
    router.wait_workers(3)
    info = inspect(big_gguf)
    # The balanced plan: one layer each; the stages' share is what llama.cpp hashes.
    hashed = stage_tensors(info, 1, 1, False) + stage_tensors(info, 2, 2, True)
    share = sum(t.nbytes for t in hashed)

    cold = _deploy(router, big_gguf)
    shards = cold["shards"]
    assert isinstance(shards, list)
    assert [s["layers"] for s in shards] == [[0, 0], [1, 1], [2, 2]]
    assert [s["seed"] for s in shards] == [None, None, None]
    cold_sent = _sent(cold)
    answers = [ask(router, NAME, p) for p in PROMPTS[:2]]
    assert answers == [ask(router, ONE_MACHINE, p) for p in PROMPTS[:2]]
    r = http_calls.post(
        router.url + "/api/v1/pipeline/undeploy", json={"name": NAME}, headers=router.headers
    )
    assert r.status_code == 200

    for proc in cold_stages:  # the same stages, now with their RPC cache
        proc.stop()
    stages = {name: _worker(cluster, router, name, big_gguf) for name in ("s1", "s2")}
    router.wait_workers(3)
    seeded = _deploy(router, big_gguf)
    seeded_sent = _sent(seeded)
    shards = seeded["shards"]
    assert isinstance(shards, list)
    seeds = [s["seed"] for s in shards[1:]]
    assert [(s["tensors"], s["cached"], s["error"]) for s in seeds] == [(3, 0, None), (4, 0, None)]
    assert sum(s["bytes"] for s in seeds) == share
    assert all(s["seconds"] > 0 for s in seeds)
    assert [ask(router, NAME, p) for p in PROMPTS[:2]] == answers

    # What the deploys sent the stages through the tunnel, against their hashed weights.
    assert cold_sent >= share, (cold_sent, share)
    assert seeded_sent <= 0.05 * share, (seeded_sent, share)

    # A stage dies: the redeploy finds its layers in the cache and sends no weights again.
    [stage] = rpc_servers(stages["s2"].pid)
    stage.kill()
    wait_until(lambda: deployment(router, NAME)["state"] != "serving", 30, "the failure")
    again = _serving(router)
    assert _sent(again) <= 0.05 * share, (_sent(again), share)
    shards = again["shards"]
    assert isinstance(shards, list)
    assert shards[2]["seed"]["cached"] == shards[2]["seed"]["tensors"] == 4
    assert [ask(router, NAME, p) for p in PROMPTS[:2]] == answers

    metrics = http_calls.get(router.url + "/metrics", headers=router.headers).text
    sample = f'shoal_tunnel_bytes_total{{deployment="{NAME}",direction="to_stages"}}'
    assert sample in metrics
