"""Image generation through the router: real router and worker processes, the real diffusers
pipeline code on a tiny random Stable Diffusion pipeline loaded from disk, the official
``openai`` client."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from PIL import Image

import http_calls
from cluster import API_KEY, Cluster, Router, iter_sse, wait_until
from fakes.fake_a1111 import CHECKPOINTS, FakeA1111

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
SMALL: dict[str, Any] = {"steps": 3}
"""Extra body fields: few steps keep each image well under a second."""


@pytest.fixture(scope="module")
def image_router(session_cluster: Cluster, tiny_sd_pipeline: Path) -> Iterator[Router]:
    """A router with one worker that serves only the tiny image model."""
    router = session_cluster.router()
    worker = session_cluster.worker(
        router,
        "--image-model",
        str(tiny_sd_pipeline),
        "--image-model-alias",
        MODEL,
        name="images",
        model=False,
    )
    router.wait_workers(1, timeout=120)
    yield router
    worker.stop()
    router.proc.stop()


@pytest.fixture
def client(image_router: Router) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=image_router.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    ) as c:
        yield c


def _png(b64: str | None) -> bytes:
    assert b64 is not None
    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return data


def _generate(client: openai.OpenAI, seed: int, **extra: Any) -> Any:
    return client.images.generate(
        model=MODEL,
        prompt="a red cat on a house",
        size="64x64",  # type: ignore[arg-type]  # any WxH is allowed here
        response_format="b64_json",
        extra_body={**SMALL, "seed": seed, **extra},
    )


def test_same_seed_gives_identical_bytes_and_another_seed_another_image(
    client: openai.OpenAI,
) -> None:
    first = _generate(client, 7)
    again = _generate(client, 7)
    other = _generate(client, 8)
    a, b, c = (_png(r.data[0].b64_json) for r in (first, again, other))
    assert a == b
    assert a != c
    assert Image.open(io.BytesIO(a)).size == (64, 64)
    extra = first.model_extra or {}
    assert extra["seed"] == 7
    assert extra["parameters"]["steps"] == 3
    assert extra["parameters"]["width"] == 64


def test_n_images_use_consecutive_seeds(client: openai.OpenAI) -> None:
    pair = client.images.generate(
        model=MODEL,
        prompt="a blue sky",
        n=2,
        size="64x64",  # type: ignore[arg-type]
        extra_body={**SMALL, "seed": 100},
    )
    single = client.images.generate(
        model=MODEL,
        prompt="a blue sky",
        size="64x64",
        extra_body={**SMALL, "seed": 101},  # type: ignore[arg-type]
    )
    assert [(d.model_extra or {})["seed"] for d in pair.data] == [100, 101]
    assert _png(pair.data[1].b64_json) == _png(single.data[0].b64_json)


def test_a_seed_is_picked_and_reported_when_none_is_given(client: openai.OpenAI) -> None:
    made = client.images.generate(model=MODEL, prompt="a dog", size="64x64", extra_body=SMALL)  # type: ignore[arg-type]
    seed = (made.model_extra or {})["seed"]
    assert isinstance(seed, int)
    again = _generate(client, seed, prompt="a dog")
    assert _png(again.data[0].b64_json) == _png(made.data[0].b64_json)


def test_img2img_changes_the_input_and_is_reproducible(client: openai.OpenAI) -> None:
    source = _png(_generate(client, 1).data[0].b64_json)

    def edit(seed: int, strength: float) -> bytes:
        made = client.images.edit(
            model=MODEL,
            image=("in.png", source, "image/png"),
            prompt="a green tree",
            extra_body={**SMALL, "seed": seed, "strength": strength},
        )
        return _png(made.data[0].b64_json)

    out = edit(5, 0.7)
    assert out != source
    assert Image.open(io.BytesIO(out)).size == (64, 64)
    assert edit(5, 0.7) == out
    assert edit(5, 0.4) != out


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "size": "65x64"}, "size"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "size": "4096x4096"}, "size"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "steps": 1000}, "steps"),
        ({"prompt": "x", "cfg_scale": "high"}, "cfg_scale"),
        ({"prompt": "x", "sampler": "Nope"}, "sampler"),
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "wings": 2}, "wings"),
        ({"prompt": "x", "model": "no-such-model"}, "model"),
    ],
)
def test_bad_generation_requests_get_a_400_naming_the_field(
    image_router: Router, body: dict[str, Any], param: str
) -> None:
    r = http_calls.post(
        image_router.url + "/v1/images/generations",
        json={"model": MODEL, **body} if "model" not in body else body,
        headers=image_router.headers,
        timeout=30,
    )
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_bad_input_images_get_a_400(client: openai.OpenAI, image_router: Router) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.edit(model=MODEL, image=("in.png", b"not an image", "image/png"), prompt="x")
    assert "PNG" in str(caught.value)
    r = http_calls.post(
        image_router.url + "/v1/images/edits",
        json={"model": MODEL, "prompt": "x", "image": "%%%"},
        headers=image_router.headers,
    )
    assert r.status_code == 400
    assert "base64" in r.json()["error"]["message"]
    # A PNG signature with a broken body passes the router's check; the worker refuses it.
    broken = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode()
    r = http_calls.post(
        image_router.url + "/v1/images/edits",
        json={"model": MODEL, "prompt": "x", "image": broken, **SMALL},
        headers=image_router.headers,
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "cannot be read" in r.json()["error"]["message"]


def test_streamed_generation_sends_step_progress_then_the_result(image_router: Router) -> None:
    events = []
    with http_calls.stream(
        "POST",
        image_router.url + "/v1/images/generations",
        json={
            "model": MODEL,
            "prompt": "sea",
            "size": "64x64",
            "steps": 4,
            "seed": 3,
            "stream": True,
        },
        headers=image_router.headers,
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(iter_sse(r))
    assert events[-1] == "[DONE]"
    parsed = [orjson.loads(e) for e in events[:-1]]
    steps = [e["step"] for e in parsed if e["type"] == "image_generation.progress"]
    assert steps == [1, 2, 3, 4]
    final = parsed[-1]
    assert final["type"] == "image_generation.completed"
    assert final["seed"] == 3
    _png(final["data"][0]["b64_json"])


def test_jobs_api_runs_txt2img_and_img2img_with_progress(image_router: Router) -> None:
    headers = image_router.headers

    def run(body: dict[str, Any]) -> dict[str, Any]:
        r = http_calls.post(image_router.url + "/v1/jobs", json=body, headers=headers)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]

        def finished() -> dict[str, Any] | None:
            job: dict[str, Any] = http_calls.get(
                f"{image_router.url}/v1/jobs/{job_id}", headers=headers
            ).json()
            return job if job["status"] not in ("queued", "running") else None

        result: dict[str, Any] = wait_until(finished, 120, "the image job to end")
        return result

    job = run(
        {
            "type": "txt2img",
            "model": MODEL,
            "prompt": "a car",
            "size": "64x64",
            "steps": 5,
            "seed": 9,
        }
    )
    assert job["status"] == "succeeded", job
    assert job["progress"] == {"step": 5, "total_steps": 5, "progress": 1.0, "images": 1}
    assert job["result"]["seed"] == 9
    source = job["result"]["data"][0]["b64_json"]
    edited = run(
        {
            "type": "img2img",
            "model": MODEL,
            "prompt": "a man",
            "image": source,
            "steps": 4,
            "strength": 0.5,
            "seed": 9,
        }
    )
    assert edited["status"] == "succeeded", edited
    assert edited["progress"]["total_steps"] == 2  # strength 0.5 runs half the steps
    assert edited["result"]["data"][0]["b64_json"] != source
    bad = http_calls.post(
        image_router.url + "/v1/jobs",
        json={"type": "txt2img", "model": MODEL, "prompt": "x", "size": "7x7"},
        headers=headers,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "size"


def test_a1111_style_routes_answer_like_automatic1111(image_router: Router) -> None:
    body = {
        "prompt": "a cat",
        "negative_prompt": "dog",
        "steps": 3,
        "cfg_scale": 5,
        "width": 64,
        "height": 64,
        "seed": 11,
        "batch_size": 2,
        "sampler_name": "Euler",
    }
    r = http_calls.post(
        image_router.url + "/sdapi/v1/txt2img", json=body, headers=image_router.headers, timeout=60
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert len(answer["images"]) == 2
    info = orjson.loads(answer["info"])
    assert info["all_seeds"] == [11, 12]
    assert info["sampler"] == "Euler"
    models = http_calls.get(
        image_router.url + "/sdapi/v1/sd-models", headers=image_router.headers
    ).json()
    assert [m["model_name"] for m in models] == [MODEL]


def test_image_jobs_go_only_to_image_workers(image_router: Router) -> None:
    """The image worker serves no text: a chat request for its model is refused."""
    r = http_calls.post(
        image_router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers=image_router.headers,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unsupported_endpoint"


def test_a1111_adapter_worker_serves_through_the_router(session_cluster: Cluster) -> None:
    with FakeA1111.start() as a1111:
        router = session_cluster.router()
        worker = session_cluster.worker(
            router,
            "--image-backend-url",
            a1111.url,
            "--image-model",
            CHECKPOINTS[1],
            "--image-model-alias",
            "forge",
            name="forge",
            model=False,
        )
        try:
            router.wait_workers(1, timeout=60)
            assert a1111.checkpoint == CHECKPOINTS[1]
            with openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0) as c:
                made = c.images.generate(
                    model="forge",
                    prompt="a house",
                    size="64x64",  # type: ignore[arg-type]
                    extra_body={"seed": 5, "steps": 2},
                )
            assert (made.model_extra or {})["seed"] == 5
            assert Image.open(io.BytesIO(_png(made.data[0].b64_json))).size == (64, 64)
            sent = [body for method, path, body in a1111.requests if path == "/sdapi/v1/txt2img"]
            assert sent[-1]["prompt"] == "a house"
            assert sent[-1]["seed"] == 5
        finally:
            worker.stop()
            router.proc.stop()


def test_image_jobs_cross_routers_sharing_redis(
    session_cluster: Cluster, tiny_sd_pipeline: Path, redis_prefix: str
) -> None:
    """Two routers on one Redis: a request to the router without workers is served by the
    image worker of the other, progress events and async-job progress included."""
    shared = ("--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", redis_prefix)
    front, back = session_cluster.router(*shared), session_cluster.router(*shared)
    worker = session_cluster.worker(
        back,
        "--image-model",
        str(tiny_sd_pipeline),
        "--image-model-alias",
        MODEL,
        name="redis-images",
        model=False,
    )
    try:
        back.wait_workers(1, timeout=120)
        front.wait_workers(1, timeout=30)
        body = {"model": MODEL, "prompt": "sea", "size": "64x64", "steps": 3, "seed": 3}
        with http_calls.stream(
            "POST",
            front.url + "/v1/images/generations",
            json={**body, "stream": True},
            headers=front.headers,
            timeout=60,
        ) as r:
            assert r.status_code == 200
            events = list(iter_sse(r))
        kinds = [orjson.loads(e)["type"] for e in events[:-1]]
        assert kinds == ["image_generation.progress"] * 3 + ["image_generation.completed"]
        r = http_calls.post(
            front.url + "/v1/jobs", json={"type": "txt2img", **body}, headers=front.headers
        )
        assert r.status_code == 202, r.text
        job_url = f"{back.url}/v1/jobs/{r.json()['id']}"  # any router reads any job

        def ended() -> dict[str, Any] | None:
            job: dict[str, Any] = http_calls.get(job_url, headers=back.headers).json()
            return job if job["status"] not in ("queued", "running") else None

        job = wait_until(ended, 120, "the job to end")
        assert job["status"] == "succeeded", job
        assert job["progress"]["step"] == 3
        assert (
            job["result"]["data"][0]["b64_json"] == orjson.loads(events[-2])["data"][0]["b64_json"]
        )
    finally:
        worker.stop()
        front.proc.stop()
        back.proc.stop()


def test_a_worker_switches_between_its_image_models_on_request(
    session_cluster: Cluster, tiny_sd_pipeline: Path, tmp_path: Path
) -> None:
    """Two image models, room for one: each request for the other unloads the first."""
    other = tmp_path / "other-sd"
    shutil.copytree(tiny_sd_pipeline, other)
    router = session_cluster.router()
    worker = session_cluster.worker(
        router,
        "--image-model",
        f"{tiny_sd_pipeline},{other}",
        "--image-max-loaded",
        "1",
        name="two-models",
        model=False,
    )
    try:
        router.wait_workers(1, timeout=120)
        listed = http_calls.get(router.url + "/sdapi/v1/sd-models", headers=router.headers).json()
        assert sorted(m["model_name"] for m in listed) == ["other-sd", "tiny-sd"]
        body = {"prompt": "x", "size": "64x64", "steps": 2, "seed": 4}
        url = router.url + "/v1/images/generations"
        for model in ("other-sd", "tiny-sd", "other-sd"):
            r = http_calls.post(
                url, json={**body, "model": model}, headers=router.headers, timeout=60
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
        log = worker.log()
        assert log.count("unloading to make room") == 3, log[-3000:]
        no_model = http_calls.post(url, json=body, headers=router.headers)
        assert no_model.status_code == 400
        assert "Several image models" in no_model.json()["error"]["message"]
    finally:
        worker.stop()
        router.proc.stop()


def test_an_idle_image_model_is_unloaded_and_loads_again_for_the_next_job(
    session_cluster: Cluster, tiny_sd_pipeline: Path
) -> None:
    router = session_cluster.router()
    worker = session_cluster.worker(
        router,
        "--image-model",
        str(tiny_sd_pipeline),
        "--idle-unload",
        "2",
        name="idle-images",
        model=False,
    )
    try:
        router.wait_workers(1, timeout=120)
        body = {"prompt": "x", "size": "64x64", "steps": 2, "seed": 4}
        url = router.url + "/v1/images/generations"
        first = http_calls.post(url, json=body, headers=router.headers, timeout=60)
        assert first.status_code == 200, first.text
        wait_until(
            lambda: router.workers()[0]["state"] == "unloaded", 30, "the idle image model unloaded"
        )
        again = http_calls.post(url, json=body, headers=router.headers, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["data"] == first.json()["data"]
        assert router.workers()[0]["state"] == "ready"
    finally:
        worker.stop()
        router.proc.stop()


def test_image_models_load_and_unload_on_request(
    session_cluster: Cluster, tiny_sd_pipeline: Path, tmp_path: Path
) -> None:
    """The router lists each image model's own state and loads or unloads one when asked."""
    other = tmp_path / "other-sd"
    shutil.copytree(tiny_sd_pipeline, other)
    router = session_cluster.router()
    worker = session_cluster.worker(
        router,
        *("--image-model", f"{tiny_sd_pipeline},{other}", "--image-max-loaded", "1"),
        name="controlled",
        model=False,
    )

    def states() -> dict[str, str]:
        r = http_calls.get(router.url + "/v1/models", headers=router.headers, timeout=10)
        return {m["id"]: m["state"] for m in r.json()["data"]}

    def control(action: str, model: str) -> httpx.Response:
        return http_calls.post(
            f"{router.url}/api/v1/models/{action}",
            json={"model": model},
            headers=router.headers,
            timeout=10,
        )

    try:
        router.wait_workers(1, timeout=120)
        wait_until(lambda: states() == {"tiny-sd": "ready", "other-sd": "unloaded"}, 60, "start")
        r = control("load", "other-sd")
        assert r.status_code == 202, r.text
        assert [w["worker_name"] for w in r.json()["workers"]] == ["controlled"]
        wait_until(
            lambda: states() == {"tiny-sd": "unloaded", "other-sd": "ready"}, 60, "the switch"
        )
        assert control("unload", "other-sd").status_code == 202
        wait_until(lambda: states()["other-sd"] == "unloaded", 60, "the unload")
        # A job loads it again.
        body = {"model": "other-sd", "prompt": "x", "size": "64x64", "steps": 2, "seed": 4}
        r = http_calls.post(
            router.url + "/v1/images/generations", json=body, headers=router.headers, timeout=60
        )
        assert r.status_code == 200, r.text
        assert states()["other-sd"] == "ready"
        missing = control("load", "no-such-model")
        assert missing.status_code == 404 and "GET /v1/models" in missing.json()["error"]["message"]
        assert control("reload", "tiny-sd").status_code == 404  # no such action route
    finally:
        worker.stop()
        router.proc.stop()
