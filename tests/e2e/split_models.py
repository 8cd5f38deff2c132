"""Helpers for the split-model e2e tests: the deployments API, greedy answers, shard processes."""

from __future__ import annotations

import contextlib
import json
from threading import Event
from typing import Any

import psutil

import http_calls
from cluster import Router, iter_sse, wait_until

PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]
GREEDY = {"temperature": 0, "max_tokens": 48, "cache_prompt": False}


def status(router: Router) -> list[dict[str, object]]:
    r = http_calls.get(router.url + "/api/v1/pipeline/status", headers=router.headers, timeout=10)
    r.raise_for_status()
    data: list[dict[str, object]] = r.json()["data"]
    return data


def deployment(router: Router, name: str) -> dict[str, object]:
    return next(d for d in status(router) if d["name"] == name)


def head_timed(router: Router, name: str) -> list[dict[str, Any]]:
    """``name``'s shards once its head has reported every stage's RPC round trips (it does
    every few seconds while it serves, when a stage answered something new)."""

    def shards() -> list[dict[str, Any]] | None:
        found = deployment(router, name)["shards"]
        assert isinstance(found, list)
        return found if all(s["link"]["rtt_ms"] for s in found[1:]) else None

    shards_now: list[dict[str, Any]] = wait_until(
        shards, 30, f"the head of {name} to report its stages' round trips"
    )
    return shards_now


def ask(router: Router, model: str, prompt: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], **GREEDY}
    r = http_calls.post(
        router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=120
    )
    assert r.status_code == 200, r.text
    content: str = r.json()["choices"][0]["message"]["content"]
    return content


def long_stream(
    router: Router, model: str, first: Event, max_tokens: int = 1500
) -> tuple[str, str | None, int]:
    """A greedy stream of ``max_tokens`` tokens from ``model`` (long enough to span a
    rebalance): its text, finish reason, chunks. ``first`` is set at the first chunk."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    text, finish, chunks = "", None, 0
    with http_calls.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=router.headers, timeout=600
    ) as r:
        assert r.status_code == 200, r.read()
        for data in iter_sse(r):
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
            chunks += 1
            first.set()
    return text, finish, chunks


def is_head(p: psutil.Process) -> bool:
    return p.name() == "llama-server" and "--rpc" in p.cmdline()


def rpc_servers(worker_pid: int) -> list[psutil.Process]:
    """The worker's ggml-rpc-server children (one that exits while being looked at, as a
    stopping stage does, is not one)."""
    found = []
    for p in psutil.Process(worker_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.name() == "ggml-rpc-server":
                found.append(p)
    return found
