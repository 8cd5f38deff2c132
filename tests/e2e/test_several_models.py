"""Several text models on one worker: a real router, a real ``shoal worker`` given a models
file (the default model twice, under two aliases; the first pinned and preloaded) and a
``--memory-budget`` that holds one of them, and the official ``openai`` client.

Both models answer; the router lists each with its own state; with nothing pinned, each
request for the other model evicts the loaded one (a streamed one waits for the load too);
with the first pinned, the second, which does not fit beside it, is never loaded and the
first never evicted.

Then each model a copy of the default model's GGUF, and a budget of 256 MiB that holds one:
an evicted conversation comes back with its KV cache restored; concurrent requests share one
load; a model that cannot fit is refused at once with its numbers; a Hugging Face repo named
with its quantization serves beside a local model.
"""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cluster import API_KEY, Cluster, Router, wait_until
from fakes.fake_hub import FakeHub
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


def _stream_evicted_smol_b(router: Router) -> dict[str, dict[str, Any]]:
    """Stream an answer of smol-b, which is not loaded: the client sees ``: loading
    model=smol-b`` and then content; smol-a is evicted for it. The models after."""
    body = {"model": "smol-b", "messages": HELLO, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=60
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert ": loading model=smol-b" in lines, lines[:3]
    assert any(line.startswith("data: ") and '"content"' in line for line in lines)
    models: dict[str, dict[str, Any]] = wait_until(
        lambda: (m := _models(router))["smol-a"]["state"] == "unloaded" and m,
        10,
        "smol-a evicted",
    )
    return models


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
    models = _stream_evicted_smol_b(router)
    assert models["smol-b"]["state"] == "ready"
    assert models["smol-a"]["loads"] == 2 and models["smol-a"]["evictions"] == 2
    assert models["smol-b"]["loads"] == 2 and models["smol-b"]["evictions"] == 1
    assert models["smol-b"]["resident_bytes"] > 0 and models["smol-b"]["load_seconds"] > 0
    client.close()


def test_a_model_that_cannot_fit_beside_a_pinned_one_never_evicts_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The router sees from the worker's report that smol-b does not fit beside the pinned
    smol-a, so it never sends the job (the worker would refuse it too:
    ``tests/worker/text/residency``); the client gets the router's 503 model_does_not_fit at
    once, naming the numbers, not after --max-wait (60 s here)."""
    router = cluster.router("--max-wait", "60")
    _worker(cluster, router, tmp_path, pinned=True)
    router.wait_workers(1)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(model="smol-a", messages=HELLO, max_tokens=4)
    assert r.choices[0].message.content
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="smol-b", messages=HELLO, max_tokens=4)
    assert caught.value.status_code == 503 and "smol-b" in str(caught.value)
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "model_does_not_fit", body
    assert "pinned" in body["message"] and "MiB" in body["message"], body
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
    models = _stream_evicted_smol_b(router)
    assert models["smol-b"]["state"] == "ready" and models["smol-a"]["evictions"] == 1
    client.close()


# ------------------------------------------- each model a copy of its own, one fits at once

ONE_MODEL_BUDGET_GIB = "0.25"
SYSTEM = "You are the support assistant of a parcel company. " + " ".join(
    f"Rule {i}: answer politely about parcel number {i * 37}." for i in range(40)
)


def _copies_file(tmp: Path, model_path: Path, *names: str, extra: str = "") -> Path:
    """A models file serving a copy of the default model under each of ``names``."""
    lines = []
    for name in names:
        copy = tmp / f"{name}.gguf"
        shutil.copyfile(model_path, copy)
        lines += [
            "[[models]]",
            f'model = "{copy}"',
            f'alias = "{name}"',
            "slots = 2",
            "ctx_size = 1024",
            "",
        ]
    path = tmp / "models.toml"
    path.write_text("\n".join(lines) + extra)
    return path


def _chat(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> Any:
    return client.chat.completions.create(
        model=model,
        max_tokens=8,
        temperature=0,
        messages=messages,
    )


def _start(cluster: Cluster, tmp_path: Path, model_path: Path, *names: str) -> Router:
    router = cluster.router()
    cluster.worker(
        router,
        *("--llama-server-path", str(cluster.llama_server)),
        *("--models-file", str(_copies_file(tmp_path, model_path, *names))),
        *("--memory-budget", ONE_MODEL_BUDGET_GIB),
        model=False,
    )
    router.wait_workers(1, timeout=120)
    wait_until(lambda: len(_models(router)) == len(names), 60, "the worker's models")
    return router


def test_two_models_answer_and_an_evicted_conversation_comes_back_cached(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    router = _start(cluster, tmp_path, model_path, "alpha", "beta")
    with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        listed = {m.id for m in client.models.list()}
        assert listed == {"alpha", "beta"}
        conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        first = _chat(client, "alpha", conversation)
        assert first.model == "alpha" and first.choices[0].message.content
        # beta does not fit beside alpha: alpha is evicted (its slots' KV cache saved first)
        other = _chat(client, "beta", [{"role": "user", "content": "Hello"}])
        assert other.model == "beta" and other.choices[0].message.content
        models = _models(router)
        assert models["alpha"]["state"] == "unloaded" and models["alpha"]["evictions"] == 1
        assert models["beta"]["state"] == "ready"
        # alpha's conversation returns: alpha loads again, evicting beta, and its restored
        # cache holds the conversation's prefix
        conversation += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And parcel 74?"},
        ]
        back = _chat(client, "alpha", conversation)
    assert first.usage is not None and back.usage is not None
    details = back.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= 0.9 * first.usage.prompt_tokens, back.usage
    models = _models(router)
    assert models["alpha"]["loads"] == 2 and models["beta"]["evictions"] == 1
    for m in models.values():  # what llama-server reported replaced the estimate
        assert 100 * 2**20 < m["resident_bytes"] < 200 * 2**20, m
        assert m["load_seconds"] > 0
    (worker,) = router.workers()
    budget = worker["model_budget_bytes"]
    resident = sum(m["resident_bytes"] for m in models.values() if m["state"] == "ready")
    assert resident <= budget == int(float(ONE_MODEL_BUDGET_GIB) * 2**30)


def test_concurrent_requests_share_one_load_and_a_stream_sees_it_loading(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    router = _start(cluster, tmp_path, model_path, "alpha", "beta")
    assert _models(router)["beta"]["state"] != "ready"  # only the first is preloaded
    loads_before = _models(router)["beta"]["loads"]
    body = {"model": "beta", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

    def plain() -> str:
        with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as c:
            return _chat(c, "beta", body["messages"]).choices[0].message.content or ""

    def streamed() -> list[str]:
        with httpx.stream(
            "POST",
            router.url + "/v1/chat/completions",
            json={**body, "stream": True},
            headers=router.headers,
            timeout=120,
        ) as r:
            assert r.status_code == 200
            return list(r.iter_lines())

    # as many as beta has slots, so both are placed at once (a third would queue in the
    # router until one is free, and never wait for the load)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(streamed)
        answer = pool.submit(plain)
        assert answer.result(timeout=120)
        lines = stream.result(timeout=120)
    assert ": loading model=beta" in lines, lines[:5]
    assert any(line.startswith("data: {") for line in lines) and lines[-2:] == ["data: [DONE]", ""]
    assert _models(router)["beta"]["loads"] == loads_before + 1


def test_a_model_that_cannot_fit_is_refused_with_its_numbers(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    router = cluster.router()
    worker = cluster.worker(
        router,
        *("--llama-server-path", str(cluster.llama_server)),
        *("--models-file", str(_copies_file(tmp_path, model_path, "alpha"))),
        *("--memory-budget", "0.05"),  # 51 MiB: the weights alone are 92 MiB
        model=False,
    )
    # its only model could not be preloaded: the worker is up, with nothing loaded
    wait_until(lambda: _models(router).get("alpha"), 120, "the worker's model")
    wait_until(lambda: "not preloaded" in worker.log(), 60, "the worker's preload refusal")
    with (
        openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as client,
        pytest.raises(openai.APIStatusError) as refused,
    ):
        _chat(client, "alpha", [{"role": "user", "content": "hi"}])
    # at once (not after --max-wait), with the numbers
    assert refused.value.status_code == 503
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "model_does_not_fit", body
    message = body["message"]
    assert "alpha" in message and "MiB" in message and "budget" in message, message
    assert _models(router)["alpha"]["state"] == "unloaded"


def test_a_hugging_face_repo_with_its_quantization_serves_beside_a_local_model(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    """``model = "org/repo:Q4_1"`` in the models file: listed on the stand-in Hub, its Q4_1
    file downloaded, and served beside a local one."""
    repo = "someorg/SmolLM2-135M-Instruct-GGUF"
    q4 = "SmolLM2-135M-Instruct.Q4_1.gguf"
    files = {(repo, q4): model_path, (repo, "SmolLM2-135M-Instruct.Q8_0.gguf"): model_path}
    name = f"{repo}:Q4_1"
    extra = f'[[models]]\nmodel = "{name}"\nslots = 2\nctx_size = 1024\n'
    with FakeHub.start(files) as hub:
        router = cluster.router()
        cluster.worker(
            router,
            *("--llama-server-path", str(cluster.llama_server)),
            *("--models-file", str(_copies_file(tmp_path, model_path, "alpha", extra=extra))),
            model=False,
            env={"HF_ENDPOINT": hub.url},
        )
        router.wait_workers(1, timeout=120)
        wait_until(lambda: len(_models(router)) == 2, 60, "the worker's models")
        with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as c:
            assert {m.id for m in c.models.list()} == {"alpha", name}
            for model in ("alpha", name):
                reply = _chat(c, model, [{"role": "user", "content": "hi"}])
                assert reply.model == model and reply.choices[0].message.content


def test_an_image_model_serves_beside_several_text_models(
    cluster: Cluster, tmp_path: Path, model_path: Path, tiny_sd_pipeline: Path
) -> None:
    """One worker: two text models in one model's budget, and the tiny image model. Each
    answers; a text model's eviction leaves the image model be."""
    router = cluster.router()
    cluster.worker(
        router,
        *("--llama-server-path", str(cluster.llama_server)),
        *("--models-file", str(_copies_file(tmp_path, model_path, "alpha", "beta"))),
        *("--memory-budget", ONE_MODEL_BUDGET_GIB),
        *("--image-model", str(tiny_sd_pipeline), "--image-model-alias", "tiny-sd"),
        model=False,
    )
    router.wait_workers(1, timeout=120)
    wait_until(lambda: len(_models(router)) == 3, 60, "the worker's three models")
    with openai.OpenAI(
        base_url=router.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    ) as client:
        assert {m.id for m in client.models.list()} == {"alpha", "beta", "tiny-sd"}
        for model in ("alpha", "beta"):  # beta evicts alpha
            reply = _chat(client, model, [{"role": "user", "content": "hi"}])
            assert reply.model == model and reply.choices[0].message.content
        image = client.images.generate(
            model="tiny-sd",
            prompt="a red cat",
            size="64x64",  # type: ignore[arg-type]  # any WxH is allowed here
            response_format="b64_json",
            extra_body={"steps": 2, "seed": 1},
        )
    assert image.data and image.data[0].b64_json
    models = _models(router)
    assert models["alpha"]["evictions"] == 1 and models["beta"]["state"] == "ready"
    assert models["tiny-sd"]["state"] == "ready"
