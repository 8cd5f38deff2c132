"""A model split over three workers with llama.cpp's RPC backend, deployed through the router.

Real router, three real workers (each with its own llama-server for its own model), the
real default model split by layers: the head runs ``llama-server --rpc`` and the two stages
``ggml-rpc-server``. The split must answer greedy requests token for token as one machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest
from split_models import PROMPTS, ask, deployment, is_head, rpc_servers, status

import http_calls
from cluster import MODEL, Cluster, Router, wait_until
from shoal.llama_cpp.threads import SPINCOUNT

pytestmark = pytest.mark.e2e


@dataclass
class Split:
    router: Router
    names: list[str]
    pids: list[int]


@pytest.fixture
def three(cluster: Cluster) -> Iterator[Split]:
    router = cluster.router()
    names = ["w1", "w2", "w3"]
    procs = [
        cluster.worker(
            router, "--slots", "1", "--ctx-size", "1024", "--rpc-host", "127.0.0.1", name=name
        )
        for name in names
    ]
    router.wait_workers(3)
    yield Split(router, names, [p.pid for p in procs])


@pytest.mark.parametrize("mode", ["relayed", "direct"])
def test_split_over_three_workers_answers_as_one_machine(
    three: Split, cluster: Cluster, mode: str
) -> None:
    router = three.router
    body = {
        "model": str(cluster.model_path),
        "name": "smol-split",
        "workers": three.names,
        "ctx": 2048,
        "strategy": "balanced",
        "mode": mode,
    }
    r = http_calls.post(
        router.url + "/api/v1/pipeline/deploy", json=body, headers=router.headers, timeout=30
    )
    assert r.status_code == 202, r.text
    assert r.json()["name"] == "smol-split"
    served = wait_until(
        lambda: (d := deployment(router, "smol-split"))["state"] == "serving" and d,
        120,
        "the split model to serve",
    )
    shards = served["shards"]
    assert [s["role"] for s in shards] == ["head", "stage", "stage"]
    assert [s["worker_name"] for s in shards] == three.names
    assert [s["layers"] for s in shards] == [[0, 9], [10, 19], [20, 29]]
    # What llama-server reports it placed is what was planned: 10 layers on each.
    head = shards[0]
    assert [p["device"] for p in head["placement"]] == ["CPU", "RPC0", "RPC1"]
    assert [p["layers"] for p in head["placement"]] == [10, 10, 10]
    assert served["tensor_split"] == [10, 11] and served["n_gpu_layers"] == 21
    assert served["devices"] == ["RPC0", "RPC1"]  # no GPU here: the head keeps its layers
    assert served["layout"] == [
        "w1/CPU layers 0-9 + token embedding",
        "w2/CPU layers 10-19",
        "w3/CPU layers 20-29",
    ]
    holders = [(p["worker_name"], p["worker_device"]) for p in head["placement"]]
    assert holders == [("w1", "CPU"), ("w2", "CPU"), ("w3", "CPU")]

    # No RPC server listens beyond 127.0.0.1 (direct mode here binds --rpc-host 127.0.0.1).
    stages = [p for pid in three.pids[1:] for p in rpc_servers(pid)]
    assert len(stages) == 2
    listening = [c.laddr for p in stages for c in p.net_connections() if c.status == "LISTEN"]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    # Stages take the worker's --threads (1 for the workers here), and every process of the
    # split spins only briefly when it waits (llama_cpp.threads: what makes the split fast
    # when its processes share cores).
    heads = [p for p in psutil.Process(three.pids[0]).children(recursive=True) if is_head(p)]
    assert len(heads) == 1
    head_argv = heads[0].cmdline()  # only the stages' devices: RPC0 and RPC1
    assert head_argv[head_argv.index("--device") + 1] == "RPC0,RPC1", head_argv
    for p in stages:
        argv = p.cmdline()
        assert argv[argv.index("-t") + 1] == "1", argv
        assert argv[argv.index("-d") + 1] == "CPU", argv  # the device the plan gave it
    for p in [*stages, *heads]:
        assert p.environ().get("GOMP_SPINCOUNT") == str(SPINCOUNT), p.cmdline()

    metrics = http_calls.get(router.url + "/metrics", headers=router.headers).text
    assert 'shoal_deployment_shards{deployment="smol-split",state="ready"} 3.0' in metrics

    models = http_calls.get(router.url + "/v1/models", headers=router.headers).json()["data"]
    assert "smol-split" in [m["id"] for m in models]
    for prompt in PROMPTS:
        assert ask(router, "smol-split", prompt) == ask(router, MODEL, prompt), prompt


def test_a_killed_stage_degrades_the_split_then_it_is_redeployed(cluster: Cluster) -> None:
    """The stage's ggml-rpc-server dies: the head's llama-server aborts, requests get a 503
    with Retry-After, and the controller redeploys; the answers are the same again. The
    deployment is kept in the database: a restarted router deploys it again by itself."""
    router = cluster.router()
    workers = {
        name: cluster.worker(router, "--slots", "1", "--ctx-size", "1024", name=name)
        for name in ("p1", "p2")
    }
    router.wait_workers(2)
    body = {"model": str(cluster.model_path), "name": "smol-split", "ctx": 1024}  # relayed
    # The router reads the GGUF's tensor table to plan: more than httpx's default 5 s on a
    # loaded machine.
    r = http_calls.post(
        router.url + "/api/v1/pipeline/deploy", json=body, headers=router.headers, timeout=60
    )
    assert r.status_code == 202, r.text
    wait_until(lambda: deployment(router, "smol-split")["state"] == "serving", 120, "serving")
    before = ask(router, "smol-split", PROMPTS[0])

    [stage] = rpc_servers(workers["p2"].pid)
    stage.kill()
    degraded = wait_until(
        lambda: (d := deployment(router, "smol-split"))["state"] in ("degraded", "starting") and d,
        30,
        "the deployment to notice",
    )
    assert "failed" in str(degraded["detail"]) or degraded["state"] == "starting", degraded
    seen_503 = False
    while deployment(router, "smol-split")["state"] != "serving":
        # Short answers: the request that lands just as it serves again is answered in full.
        body = {
            "model": "smol-split",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = http_calls.post(
            router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=60
        )
        if r.status_code == 503:
            seen_503 = True
            assert int(r.headers["retry-after"]) > 0
            assert "split over several workers" in r.json()["error"]["message"]
    assert ask(router, "smol-split", PROMPTS[0]) == before
    assert len(rpc_servers(workers["p2"].pid)) == 1  # a new stage; the killed one is gone
    assert seen_503  # the redeploy waits a backoff (2 s) first: requests saw the 503

    # The router restarts: the deployment comes back from the database.
    router.proc.stop()
    again = cluster.router(port=router.port)
    again.wait_workers(2)
    wait_until(lambda: deployment(again, "smol-split")["state"] == "serving", 120, "redeployed")
    assert ask(again, "smol-split", PROMPTS[0]) == before
    r = http_calls.post(again.url + "/api/v1/pipeline/undeploy", json={"name": "smol-split"})
    assert r.status_code == 200
    assert status(again) == []
    wait_until(lambda: not rpc_servers(workers["p2"].pid), 15, "the stage to stop")


def test_deploy_api_answers_mistakes_clearly(cluster: Cluster) -> None:
    admin = {"Authorization": "Bearer admin-key-for-the-deployments-test"}
    router = cluster.router("--admin-key", admin["Authorization"].split()[1])

    def post(path: str, headers: dict[str, str] = admin, **body: object) -> httpx.Response:
        return http_calls.post(router.url + path, json=body, headers=headers, timeout=30)

    model = str(cluster.model_path)
    assert post("/api/v1/pipeline/deploy", router.headers, model=model).status_code in (401, 403)
    r = post("/api/v1/pipeline/deploy", model="no-such-model")
    assert r.status_code == 404 and "unknown model" in r.json()["error"]["message"]
    r = post("/api/v1/pipeline/deploy", model=model, name="bad name!")
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    assert post("/api/v1/pipeline/deploy", model=model, mode="carrier-pigeon").status_code == 400
    # No worker yet: accepted, and pending with the reason.
    r = post("/api/v1/pipeline/deploy", model=model, name="later")
    assert r.status_code == 202 and r.json()["state"] == "pending"
    assert "waiting for workers" in r.json()["detail"]
    r = post("/api/v1/pipeline/deploy", model=MODEL, name="later")  # another model, same name
    assert r.status_code == 409 and "undeploy it first" in r.json()["error"]["message"]
    listed = http_calls.get(router.url + "/api/v1/pipeline/models", headers=admin).json()["data"]
    assert [(m["id"], m["state"]) for m in listed] == [("later", "pending")]
    # Requests for it meanwhile: a 503 that says why, not a 404.
    ask_it = {"model": "later", "messages": [{"role": "user", "content": "hi"}]}
    r = http_calls.post(router.url + "/v1/chat/completions", json=ask_it, headers=router.headers)
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    assert post("/api/v1/pipeline/rebalance", name="nope").status_code == 404
    assert post("/api/v1/pipeline/undeploy", name="nope").status_code == 404
    assert post("/api/v1/pipeline/undeploy", name="later").status_code == 200
    r = http_calls.post(router.url + "/v1/chat/completions", json=ask_it, headers=router.headers)
    assert r.status_code == 404
