"""Image models from elsewhere, through real router and worker processes: a single-file
``.safetensors`` checkpoint with ``--image-config`` (offline), and an attached Automatic1111
server (a FAKE one, on loopback) whose steps stream as progress events."""

from __future__ import annotations

import base64
import importlib.util
import io
import shutil
from pathlib import Path

import orjson
import pytest
from PIL import Image

import http_calls
from cluster import Cluster, iter_sse
from fakes.fake_a1111 import FakeA1111

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parents[2] / "scripts" / "make_tiny_sd_pipeline.py"


def _single_file(pipeline: Path, folder: Path) -> tuple[Path, Path]:
    """The pipeline as one LDM-layout checkpoint, and a folder of its configs (no weights)."""
    spec = importlib.util.spec_from_file_location("make_tiny_sd_pipeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checkpoint: Path = module.to_single_file(pipeline, folder / "tiny.safetensors")
    configs = folder / "configs"
    shutil.copytree(pipeline, configs, ignore=shutil.ignore_patterns("*.safetensors"))
    return checkpoint, configs


def test_a_worker_serves_a_single_file_checkpoint_offline(
    session_cluster: Cluster, tiny_sd_pipeline: Path, tmp_path: Path
) -> None:
    checkpoint, configs = _single_file(tiny_sd_pipeline, tmp_path)
    router = session_cluster.router()
    worker = session_cluster.worker(
        router,
        "--image-model",
        str(checkpoint),
        "--image-config",
        str(configs),
        "--offline",
        name="single-file",
        model=False,
        env={"HF_HUB_OFFLINE": "1"},
    )
    try:
        router.wait_workers(1, timeout=120)
        body = {"model": "tiny", "prompt": "a cat", "size": "64x64", "steps": 2, "seed": 1}
        r = http_calls.post(
            router.url + "/v1/images/generations", json=body, headers=router.headers, timeout=60
        )
        assert r.status_code == 200, r.text
        png = base64.b64decode(r.json()["data"][0]["b64_json"])
        assert Image.open(io.BytesIO(png)).size == (64, 64)
        assert "configs from" in worker.log()
    finally:
        worker.stop()
        router.proc.stop()


def test_a1111_steps_stream_as_progress_events(session_cluster: Cluster) -> None:
    with FakeA1111.start() as a1111:
        a1111.step_delay = 0.4  # 6 steps in 2.4 s: several 0.5 s progress polls
        router = session_cluster.router()
        worker = session_cluster.worker(
            router, "--image-backend-url", a1111.url, name="a1111", model=False
        )
        try:
            router.wait_workers(1, timeout=60)
            body = {"model": "a1111", "prompt": "sea", "size": "64x64", "steps": 6, "seed": 3}
            with http_calls.stream(
                "POST",
                router.url + "/v1/images/generations",
                json={**body, "stream": True},
                headers=router.headers,
                timeout=60,
            ) as r:
                assert r.status_code == 200
                events = [orjson.loads(e) for e in iter_sse(r) if e != "[DONE]"]
            progress = [e for e in events if e["type"] == "image_generation.progress"]
            steps = [e["step"] for e in progress]
            assert len(set(steps) - {6}) >= 2, steps  # seen while it ran, not only at the end
            assert steps == sorted(set(steps))
            assert steps[-1] == 6
            assert events[-1]["type"] == "image_generation.completed"
        finally:
            worker.stop()
            router.proc.stop()
