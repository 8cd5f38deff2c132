"""``shoal up``: one command gives a working endpoint; Ctrl-C leaves nothing behind."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import httpx
import openai
import pytest

from cluster import CLUSTER_TAG, MODEL, Proc, clean_env, free_port, llama_server_pids, wait_until

pytestmark = pytest.mark.e2e


def start_up(
    tmp_path: Path,
    llama_server: Path,
    model_path: Path,
    *flags: str,
    database: Path | None = None,
) -> tuple[Proc, int]:
    """``shoal up`` as a user runs it, waited on until it prints its banner."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "shoal",
        "up",
        "--port",
        str(port),
        *flags,
        "--llama-server-path",
        str(llama_server),
        "--model",
        str(model_path),
        "--model-alias",
        MODEL,
        "--slots",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    database = database or tmp_path
    env = clean_env(
        **{CLUSTER_TAG: str(tmp_path), "SHOAL_DATABASE_URL": f"sqlite:///{database}/shoal.db"}
    )
    proc = Proc("up", argv, tmp_path / "up.log", env).start()
    wait_until(lambda: "Shoal is up." in proc.log() or not proc.alive(), 90, "the banner")
    assert proc.alive(), proc.log()[-3000:]
    return proc, port


def test_up_serves_and_stops_cleanly(tmp_path: Path, llama_server: Path, model_path: Path) -> None:
    proc, port = start_up(tmp_path, llama_server, model_path)
    try:
        log = proc.log()
        assert f"http://127.0.0.1:{port}/v1" in log and f"http://127.0.0.1:{port}/" in log
        # The first run creates an inference and an admin key and shows them, once.
        key = re.search(r"API key:  (sk-shoal-\S+)", log)
        admin = re.search(r"Admin key: (ak-shoal-\S+)", log)
        assert key is not None and admin is not None, log[-2000:]
        curl = re.search(r"curl -N (\S+)", log)
        assert curl is not None and f"Bearer {key.group(1)}" in log
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(curl.group(1), json=body).status_code == 401
        auth = {"Authorization": f"Bearer {key.group(1)}"}
        r = httpx.post(curl.group(1), json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL
        base = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=base, api_key=key.group(1)) as client:
            assert [m.id for m in client.models.list()] == [MODEL]
        assert llama_server_pids(str(tmp_path))
    finally:
        proc.signal(signal.SIGINT)
        code = proc.wait(30)
    assert code == 0, proc.log()[-3000:]
    assert not llama_server_pids(str(tmp_path)), "llama-server left behind after Ctrl-C"

    # A second run keeps the keys and does not show them again.
    again, _ = start_up(tmp_path / "again", llama_server, model_path, database=tmp_path)
    try:
        assert key.group(1) not in again.log() and admin.group(1) not in again.log()
        assert "printed on the first run" in again.log()
    finally:
        again.signal(signal.SIGINT)
        assert again.wait(30) == 0


def test_up_beyond_loopback_generates_a_key(
    tmp_path: Path, llama_server: Path, model_path: Path
) -> None:
    proc, port = start_up(tmp_path, llama_server, model_path, "--host", "0.0.0.0")
    try:
        key = re.search(r"API key:  (sk-shoal-\S+)", proc.log())
        assert key is not None
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {key.group(1)}"}).is_success
        assert proc.log().count(key.group(1)) == 2  # the banner's key line and its curl only
    finally:
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0
