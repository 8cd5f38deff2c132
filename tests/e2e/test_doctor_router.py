"""``shoal doctor --router-url`` against a real router: reachable, and the worker's key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import http_calls
from cluster import GPU_KEY, Cluster, clean_env, free_port

pytestmark = pytest.mark.e2e


def router_check(url: str, gpu_key: str | None) -> tuple[int, dict[str, Any]]:
    env = clean_env(PATH=os.environ["PATH"])
    if gpu_key is not None:
        env["SHOAL_GPU_KEY"] = gpu_key
    done = subprocess.run(
        [sys.executable, "-m", "shoal", "doctor", "--json", "--router-url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    [check] = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "router"]
    return done.returncode, check


def test_the_router_accepts_the_key_or_says_why_not(session_cluster: Cluster) -> None:
    router = session_cluster.router()
    url = f"127.0.0.1:{router.port}"

    _, ok = router_check(url, GPU_KEY)
    assert ok["status"] == "ok", ok
    assert ok["finding"].startswith(f"ws://{url}/ws/worker (Shoal ")
    assert ok["finding"].endswith("accepts this GPU key")

    code, wrong = router_check(url, "gpu-not-this-one")
    assert (code, wrong["status"]) == (1, "error")
    assert "refuses this GPU key" in wrong["finding"]
    assert "--gpu-key" in wrong["fix"]

    health = http_calls.get(router.url + "/health", timeout=5).json()
    assert health["workers"] == 0  # the probe registered nothing
    assert "refused worker" in router.proc.log()


def test_a_router_that_does_not_answer_is_an_error() -> None:
    code, check = router_check(f"127.0.0.1:{free_port()}", GPU_KEY)
    assert (code, check["status"]) == (1, "error")
    assert "no answer from http://127.0.0.1:" in check["finding"]
    assert "--router-url" in check["fix"]
