"""The model store as users run it: `shoal data`, and embedded in the router for workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import http_calls
from cluster import API_KEY, Cluster, Proc, clean_env, free_port, wait_until
from shoal.pip_download import file_sha256

pytestmark = pytest.mark.e2e


def _stock(folder: Path, model_path: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    try:
        os.link(model_path, target)
    except OSError:
        target.write_bytes(model_path.read_bytes())
    return target


def test_worker_fetches_its_model_from_the_routers_store(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    _stock(tmp_path / "store", model_path, "Smol-Store.gguf")
    router = cluster.router("--storage", str(tmp_path / "store"))
    registry = http_calls.get(router.url + "/api/v1/models/registry", headers=router.headers).json()
    assert [m["id"] for m in registry["data"]] == ["smol-store"]
    worker = cluster.worker(
        router,
        *("--model", "smol-store", "--model-store", router.url),
        *("--llama-server-path", str(cluster.llama_server)),
        model=False,
    )
    router.wait_workers(1)
    fetched = tmp_path / "cache" / "models" / "store" / "Smol-Store.gguf"
    assert fetched.is_file() and file_sha256(fetched) == registry["data"][0]["sha256"]
    assert "smol-store" in worker.log()
    with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        r = client.chat.completions.create(
            model="smol-store", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert r.model == "smol-store" and r.choices[0].message.content


def test_shoal_data_serves_ranges(model_path: Path, tmp_path: Path) -> None:
    stored = _stock(tmp_path / "store", model_path, "smol.gguf")
    port = free_port()
    proc = Proc(
        "data",
        [
            sys.executable,
            "-m",
            "shoal",
            "data",
            "--storage",
            str(tmp_path / "store"),
            "--port",
            str(port),
        ],
        tmp_path / "data.log",
        clean_env(),
    ).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_calls.get(base + "/api/v1/models/registry").is_success, 30, "store")
        pull = http_calls.post(base + "/api/v1/models/smol/pull", json={"layers": [3, 5]}).json()
        start, end = pull["ranges"][-1]
        got = http_calls.get(base + pull["file_url"], headers={"Range": f"bytes={start}-{end - 1}"})
        assert got.status_code == 206
        with stored.open("rb") as f:
            f.seek(start)
            assert got.content == f.read(end - start)
        upload = http_calls.post(
            base + "/api/v1/storage/upload?id=x&sha256=" + "0" * 64, content=b"x"
        )
        assert upload.status_code == 403 and "admin" in upload.json()["error"]["message"]
    finally:
        proc.stop()


def test_shoal_data_refuses_open_network_without_keys(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "data", "--storage", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert r.returncode == 2 and "refusing to listen on 0.0.0.0" in r.stderr
