"""Attaching to a running OpenAI-compatible server, and serving embeddings."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cluster import Cluster, free_port, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def external_llama(llama_server: Path, model_path: Path, tmp_path: Path) -> Iterator[str]:
    """A llama-server the worker did not start, answering to another model name."""
    port = free_port()
    log = (tmp_path / "external.log").open("wb")
    proc = subprocess.Popen(
        [
            str(llama_server),
            "-m",
            str(model_path),
            "--alias",
            "backend-name",
            "--port",
            str(port),
            "-np",
            "2",
            "-c",
            "4096",
            "--threads",
            "1",
            "--no-webui",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 60, "llama-server")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_attached_backend_serves_under_public_name(
    cluster: Cluster, external_llama: str, make_client: Callable[..., openai.OpenAI]
) -> None:
    router = cluster.router()
    cluster.worker(
        router,
        "--backend-url",
        external_llama,
        "--model-alias",
        "public-name",
        "--slots",
        "2",
        model=False,
    )
    [worker] = router.wait_workers(1)
    assert worker["models"][0]["name"] == "public-name"
    client = make_client(router.url)
    r = client.chat.completions.create(
        model="public-name", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert r.model == "public-name" and r.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="public-name",
            max_tokens=4,
            stream=True,
            messages=[{"role": "user", "content": "hi"}],
        )
    )
    assert chunks and {c.model for c in chunks} == {"public-name"}


def test_embeddings_worker(cluster: Cluster, make_client: Callable[..., openai.OpenAI]) -> None:
    router = cluster.router()
    cluster.worker(router, "--embedding", "--model-alias", "smol-embed")
    router.wait_workers(1)
    client = make_client(router.url)
    r = client.embeddings.create(model="smol-embed", input=["hello world", "the sea"])
    assert len(r.data) == 2
    assert len(r.data[0].embedding) == 576  # SmolLM2-135M's embedding width
    assert r.data[0].embedding != r.data[1].embedding
    with pytest.raises(openai.BadRequestError, match="not served for /v1/chat/completions"):
        client.chat.completions.create(
            model="smol-embed", messages=[{"role": "user", "content": "hi"}]
        )


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Name a fruit."}],
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
        ("/v1/completions", {"prompt": "Apples are", "logprobs": 2}),
    ],
)
def test_assembled_answer_matches_llama_servers_own(
    external_llama: str, path: str, body: dict[str, object]
) -> None:
    """The worker streams from llama-server and assembles non-streamed answers itself."""
    import orjson

    from shoal.protocol.messages import Endpoint
    from shoal.worker.aggregate import aggregate

    body = {**body, "max_tokens": 12, "temperature": 0}
    direct = httpx.post(external_llama + path, json=body, timeout=60).json()
    chunks = []
    with httpx.stream(
        "POST",
        external_llama + path,
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[6:]))
    endpoint = Endpoint.CHAT if "chat" in path else Endpoint.COMPLETIONS
    assembled = aggregate(chunks, endpoint)
    for d in (direct, assembled):
        for volatile in ("id", "created", "timings"):
            d.pop(volatile)
        d["usage"].pop("prompt_tokens_details")
    # llama-server's non-streamed logprobs also list the end-of-generation token, which its
    # stream never sends; that one entry is the only difference allowed.
    got, want = assembled["choices"][0], direct["choices"][0]
    if want["finish_reason"] == "stop":
        extra = len(want["logprobs"]["content"]) - len(got["logprobs"]["content"])
        assert extra in (0, 1)
        del want["logprobs"]["content"][len(got["logprobs"]["content"]) :]
    assert assembled == direct
