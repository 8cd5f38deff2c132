"""``shoal up --image-model``: the same one-machine cluster serves images next to text; a
generation returns a PNG, and the same request through the jobs API completes with progress."""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any

import pytest

import http_calls
from cluster import CLUSTER_TAG, MODEL, Proc, clean_env, free_port, wait_until

pytestmark = pytest.mark.e2e

KEY = "sk-up-images-test"


def test_up_serves_images_next_to_text(
    tmp_path: Path, llama_server: Path, model_path: Path, tiny_sd_pipeline: Path
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "shoal", "up", "--port", str(port), "--api-key", KEY]
    argv += ["--llama-server-path", str(llama_server), "--model", str(model_path)]
    argv += ["--model-alias", MODEL, "--slots", "2", "--cache-dir", str(tmp_path / "cache")]
    argv += ["--image-model", str(tiny_sd_pipeline)]
    env = clean_env(
        **{CLUSTER_TAG: str(tmp_path), "SHOAL_DATABASE_URL": f"sqlite:///{tmp_path}/shoal.db"}
    )
    proc = Proc("up", argv, tmp_path / "up.log", env).start()
    try:
        wait_until(lambda: "Shoal is up." in proc.log() or not proc.alive(), 120, "the banner")
        assert "/v1/images/generations" in proc.log()
        url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
        body = {"prompt": "a lighthouse", "size": "64x64", "steps": 3, "seed": 1}
        r = http_calls.post(url + "/v1/images/generations", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        png = base64.b64decode(r.json()["data"][0]["b64_json"])
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        r = http_calls.post(url + "/v1/jobs", json={"type": "txt2img", **body}, headers=headers)
        assert r.status_code == 202, r.text
        job_url = f"{url}/v1/jobs/{r.json()['id']}"

        def ended() -> dict[str, Any] | None:
            job: dict[str, Any] = http_calls.get(job_url, headers=headers).json()
            return job if job["status"] not in ("queued", "running") else None

        job = wait_until(ended, 120, "the txt2img job to end")
        assert job["status"] == "succeeded", job
        assert job["progress"]["step"] == job["progress"]["total_steps"] == 3
        assert base64.b64decode(job["result"]["data"][0]["b64_json"]) == png
        chat = http_calls.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            headers=headers,
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
    finally:
        proc.stop()
