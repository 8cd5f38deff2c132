"""Several text models on one worker: a real router, a real ``shoal worker`` given a models
file (the default model twice, under two aliases; the first pinned and preloaded) and a
``--memory-budget`` that holds one of them, and the official ``openai`` client.

Both models answer; the router lists each with its own state; with nothing pinned, each
request for the other model evicts the loaded one (a streamed one waits for the load too);
with the first pinned, the second, which does not fit beside it, is never loaded and the
first never evicted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cluster import API_KEY, Cluster, Router, wait_until
from shoal.models.residency import Footprint
from shoal.worker.text.residency.budget import estimate_file

pytestmark = pytest.mark.e2e

HELLO: Any = [{"role": "user", "content": "Say hello in one word."}]


def _models_file(tmp_path: Path, model_path: Path, pinned: bool) -> Path:
    file = tmp_path / "models.toml"
    file.write_text(
        f'[[models]]\nmodel = "{model_path}"\nalias = "smol-a"\nctx_size = 512\nslots = 1\n'
        f"preload = true\npinned = {'true' if pinned else 'false'}\n\n"
        f'[[models]]\nmodel = "{model_path}"\nalias = "smol-b"\nctx_size = 512\nslots = 2\n'
    )
    return file


def _several(cluster: Cluster, tmp_path: Path, pinned: bool) -> tuple[str, ...]:
    """The flags for the two models. Either one's first-load estimate fits, but not beside
    the other, estimated or measured (the default model measures about 0.7 of its estimate)."""
    estimate = estimate_file(cluster.model_path, 1024, Footprint(ram=2**40))
    return (
        "--models-file",
        str(_models_file(tmp_path, cluster.model_path, pinned)),
        "--memory-budget",
        f"{estimate.ram * 1.15 / 2**30:.4f}",
    )


def _worker(cluster: Cluster, router: Router, tmp_path: Path, pinned: bool) -> None:
    several = _several(cluster, tmp_path, pinned)
    cluster.worker(router, "--llama-server-path", str(cluster.llama_server), *several, model=False)


def _models(router: Router) -> dict[str, dict[str, Any]]:
    [worker] = router.workers()
    return {m["name"]: m for m in worker["models"]}


def test_both_models_answer_and_each_evicts_the_other(cluster: Cluster, tmp_path: Path) -> None:
    router = cluster.router()
    _worker(cluster, router, tmp_path, pinned=False)
    router.wait_workers(1)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0)
    listed = {m.id for m in client.models.list()}
    assert {"smol-a", "smol-b"} <= listed
    [worker] = router.workers()
    assert worker["slots"] == 3
    for n, model in enumerate(["smol-b", "smol-a"]):
        r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=4)
        assert r.model == model and r.choices[0].message.content, n
    # Streamed, for the model just evicted: it waits while smol-b loads (the worker tells the
    # router, which shows the client an SSE comment), then streams.
    body = {"model": "smol-b", "messages": HELLO, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=60
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert ": loading model=smol-b" in lines, lines[:3]
    assert any(line.startswith("data: ") and '"content"' in line for line in lines)
    models = wait_until(
        lambda: (m := _models(router))["smol-a"]["state"] == "unloaded" and m,
        10,
        "smol-a evicted",
    )
    assert models["smol-b"]["state"] == "ready"
    assert models["smol-a"]["loads"] == 2 and models["smol-a"]["evictions"] == 2
    assert models["smol-b"]["loads"] == 2 and models["smol-b"]["evictions"] == 1
    assert models["smol-b"]["resident_bytes"] > 0 and models["smol-b"]["load_seconds"] > 0
    client.close()


def test_a_model_that_cannot_fit_beside_a_pinned_one_never_evicts_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The router sees from the worker's report that smol-b does not fit beside the pinned
    smol-a, so it never sends the job (the worker would refuse it, 503 model_does_not_fit:
    ``tests/worker/text/residency``); the client gets the router's 503 after --max-wait."""
    router = cluster.router("--max-wait", "3")
    _worker(cluster, router, tmp_path, pinned=True)
    router.wait_workers(1)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(model="smol-a", messages=HELLO, max_tokens=4)
    assert r.choices[0].message.content
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="smol-b", messages=HELLO, max_tokens=4)
    assert caught.value.status_code == 503 and "smol-b" in str(caught.value)
    models = _models(router)
    assert models["smol-a"]["pinned"] is True and models["smol-a"]["state"] == "ready"
    assert (models["smol-a"]["loads"], models["smol-a"]["evictions"]) == (1, 0)
    assert (models["smol-b"]["state"], models["smol-b"]["loads"]) == ("unloaded", 0)
    client.close()


def test_a_pull_worker_serves_several_models_too(
    cluster: Cluster, tmp_path: Path, redis_prefix: str
) -> None:
    """Pull mode (``--redis-url``): the same models, jobs taken from Redis; a streamed request
    for the unloaded model shows the load (the puller publishes the worker's JobLoading)."""
    redis_url = "redis://127.0.0.1:6379/0"
    router = cluster.router("--redis-url", redis_url, "--redis-prefix", redis_prefix)
    several = _several(cluster, tmp_path, pinned=False)
    cluster.pull_worker(redis_url, redis_prefix, *several, model=False)
    router.wait_workers(1)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(model="smol-a", messages=HELLO, max_tokens=4)
    assert r.model == "smol-a" and r.choices[0].message.content
    body = {"model": "smol-b", "messages": HELLO, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=60
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert ": loading model=smol-b" in lines, lines[:3]
    assert any(line.startswith("data: ") and '"content"' in line for line in lines)
    models = wait_until(
        lambda: (m := _models(router))["smol-a"]["state"] == "unloaded" and m,
        10,
        "smol-a evicted",
    )
    assert models["smol-b"]["state"] == "ready" and models["smol-a"]["evictions"] == 1
    client.close()
