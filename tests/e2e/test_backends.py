"""Attaching to a running OpenAI-compatible server (llama-server, vLLM), and serving
embeddings."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

import http_calls
from cluster import Cluster, Router, iter_sse, keys_cli, plain_llama_server, wait_until
from fakes.fake_vllm import FakeVllm

pytestmark = pytest.mark.e2e


@pytest.fixture
def external_llama(llama_server: Path, model_path: Path, tmp_path: Path) -> Iterator[str]:
    """A llama-server the worker did not start, answering to another model name."""
    args = ("--alias", "backend-name", "-np", "2", "-c", "4096", "--threads", "1", "--no-webui")
    with plain_llama_server(llama_server, model_path, tmp_path / "external.log", *args) as url:
        yield url


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
    from shoal.worker.text.aggregate import aggregate

    body = {**body, "max_tokens": 12, "temperature": 0}
    direct = http_calls.post(external_llama + path, json=body, timeout=60).json()
    chunks = []
    with http_calls.stream(
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


@dataclass
class Served:
    url: str
    fake: FakeVllm | None
    """None: a real vLLM."""


@pytest.fixture
def vllm() -> Iterator[Served]:
    """A server speaking vLLM's dialect: the real vLLM at ``$SHOAL_TEST_VLLM_URL`` when one is
    given (serving one model), else the fake (``tests/fakes/fake_vllm.py``)."""
    real = os.environ.get("SHOAL_TEST_VLLM_URL")
    if real:
        yield Served(real.rstrip("/"), None)
        return
    with FakeVllm.start("Qwen/Qwen2.5-0.5B-Instruct") as fake:
        yield Served(fake.url, fake)


def stream_chunks(router: Router, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every chunk of a streamed chat, as the client gets it (it must end with [DONE])."""
    chunks = []
    with http_calls.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        for data in iter_sse(r):
            if data == "[DONE]":
                return chunks
            chunks.append(json.loads(data))
    raise AssertionError(f"the stream ended without [DONE]: {chunks[-2:]}")


def test_an_attached_vllm_charges_streams_and_gives_usage_only_to_who_asks(
    cluster: Cluster, vllm: Served
) -> None:
    """vLLM (like OpenAI) counts a stream's tokens only when asked: the worker always asks,
    the router charges them to the key and its metrics, and a client that did not ask gets
    no usage (no usage-only last chunk, no ``usage`` field); one that asked gets vLLM's."""
    key = keys_cli(cluster.database_url, "create", "--scope", "inference", "--name", "streams")
    key = key.splitlines()[-1]
    router = cluster.router()
    cluster.worker(
        router, "--backend-url", vllm.url, "--model-alias", "public", "--slots", "2", model=False
    )
    router.wait_workers(1)
    tokens = 8
    body = {
        "model": "public",
        "messages": [{"role": "user", "content": "Count to ten, please."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    asked = stream_chunks(router, key, {**body, "stream_options": {"include_usage": True}})
    last = asked[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == tokens
    prompt = last["usage"]["prompt_tokens"]
    assert prompt > 0 and last["model"] == "public"

    plain = stream_chunks(router, key, body)
    assert plain and all(c["choices"] for c in plain), "no usage-only chunk"
    assert not [c for c in plain if "usage" in c], "no usage field"
    assert {c["model"] for c in plain} == {"public"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in plain)

    def charged() -> dict[str, Any] | None:
        r = http_calls.get(router.url + "/api/v1/usage?key=streams", timeout=10)
        rows = [row for row in r.json()["data"] if row["requests"] >= 2]
        return rows[0] if rows else None

    row = wait_until(charged, 30, "the key's usage")
    assert (row["tokens_in"], row["tokens_out"]) == (2 * prompt, 2 * tokens)
    metrics = http_calls.get(router.url + "/metrics", timeout=10).text
    assert f'shoal_tokens_total{{direction="out",model="public"}} {2 * tokens:.1f}' in metrics
    if vllm.fake is not None:  # what the worker asked of it
        options = [b.get("stream_options") for _, b in vllm.fake.requests if b.get("stream")]
        assert options == [{"include_usage": True}] * 2
