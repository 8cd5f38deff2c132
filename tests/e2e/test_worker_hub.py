"""A worker asked for a catalog model fetches it from the Hub (here a FAKE hub on loopback that
speaks Hugging Face's protocol), picks the quantization that fits, and serves it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from cluster import API_KEY, Cluster
from fakes.fake_hub import FakeHub
from shoal.models.catalog_file import load_catalog
from shoal.models.hub_cache import local_path

pytestmark = pytest.mark.e2e

MODEL_ID = "smollm2-360m-instruct"
CUT_AFTER = 40 * 1024 * 1024
"""The fake hub drops the first download of each file after this many bytes."""


def test_worker_downloads_resumes_picks_a_quantization_and_serves(
    cluster: Cluster, model_path: Path
) -> None:
    """Every quantization file of the entry is served with the default model's real bytes (the
    fake hub has no other real GGUF at hand), so whichever one the worker picks can load."""
    entry = load_catalog().get(MODEL_ID)
    assert entry is not None
    files = {(entry.hub.repo, q.files[0]): model_path for q in entry.hub.quants}
    with FakeHub.start(files, cut_after=dict.fromkeys(files, CUT_AFTER)) as hub:
        router = cluster.router()
        worker = cluster.worker(
            router,
            *("--model", MODEL_ID, "--llama-server-path", str(cluster.llama_server)),
            model=False,
            env={"HF_ENDPOINT": hub.url},
        )
        router.wait_workers(1, timeout=120)
        log = worker.log()
        downloads = [r for r in hub.requests if r.server == "cdn" and r.method == "GET"]
    # It picked a quantization by itself, and said why.
    chosen = next(
        q for q in entry.hub.quants if f"model {MODEL_ID}: {q.quantization}: needs" in log
    )
    assert "of" in log and "available RAM" in log
    # It fetched only that file, resumed it where the cut left it, with a progress display.
    fetched = {r.path for r in downloads}
    assert len(fetched) == 1, fetched
    ranges = [r.headers.get("range") for r in downloads]
    assert ranges[0] is None and ranges[-1] == f"bytes={CUT_AFTER}-", ranges
    assert "broke off" in log and "Downloading" in log and "100%" in log
    cached = local_path(cluster.base / "cache", entry.hub.repo, chosen.files[0])
    assert cached.read_bytes() == model_path.read_bytes()
    # And it serves it under the catalog id.
    with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        reply = client.chat.completions.create(
            model=MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.model == MODEL_ID and reply.choices[0].message.content


def test_worker_serves_a_hugging_face_repo_by_name_and_quantization(
    cluster: Cluster, model_path: Path
) -> None:
    """``--model org/repo:Q4_1``: a repo outside the catalog (the default model's real GGUF
    under another name, beside a second quantization that must not be fetched) is listed,
    its Q4_1 downloaded into the repo's own cache folder, and served under that name."""
    repo = "someorg/SmolLM2-135M-Instruct-GGUF"
    q4 = "SmolLM2-135M-Instruct.Q4_1.gguf"
    files = {(repo, q4): model_path, (repo, "SmolLM2-135M-Instruct.Q8_0.gguf"): model_path}
    name = f"{repo}:q4_1"
    with FakeHub.start(files) as hub:
        router = cluster.router()
        cluster.worker(
            router,
            *("--model", name, "--llama-server-path", str(cluster.llama_server)),
            model=False,
            env={"HF_ENDPOINT": hub.url},
        )
        router.wait_workers(1, timeout=120)
        listed = [r for r in hub.requests if r.path == f"/api/models/{repo}/tree/main"]
        whole = [r for r in hub.requests if r.server == "cdn" and r.method == "GET"]
    assert listed, "the repo's files were listed"
    assert [r.query for r in whole] == [hub.downloads(repo, q4)[0].query], "only Q4_1"
    cached = local_path(cluster.base / "cache", repo, q4)
    assert cached.read_bytes() == model_path.read_bytes()
    with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [name]
        reply = client.chat.completions.create(
            model=name, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.model == name and reply.choices[0].message.content
