"""The Automatic1111 adapter engine against a FAKE A1111 server on loopback (the real one needs
a GPU and gigabytes of weights)."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator

import pytest
from PIL import Image

from fakes.fake_a1111 import CHECKPOINTS, FakeA1111
from shoal.protocol.images import ImageJob
from shoal.worker.images.a1111 import A1111Engine, A1111Error, progress_step
from shoal.worker.images.engine import ImageInputError


@pytest.fixture
def a1111() -> Iterator[FakeA1111]:
    with FakeA1111.start() as server:
        yield server


async def test_load_switches_to_the_checkpoint_asked_for(a1111: FakeA1111) -> None:
    engine = A1111Engine(a1111.url, CHECKPOINTS[1])
    await engine.load()
    assert engine.loaded
    assert a1111.checkpoint == CHECKPOINTS[1]
    assert ("POST", "/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINTS[1]}) in a1111.requests


async def test_load_refuses_a_checkpoint_the_server_lacks(a1111: FakeA1111) -> None:
    with pytest.raises(A1111Error, match="no checkpoint 'nope'"):
        await A1111Engine(a1111.url, "nope").load()


async def test_txt2img_sends_the_a1111_fields_and_reports_seeds(a1111: FakeA1111) -> None:
    engine = A1111Engine(a1111.url)
    await engine.load()
    steps: list[tuple[int, int]] = []
    job = ImageJob(
        prompt="a cat",
        negative_prompt="dog",
        n=2,
        width=64,
        height=64,
        steps=5,
        cfg_scale=6.5,
        sampler="Euler a",
    )
    made = await engine.generate(job, 40, lambda d, t: steps.append((d, t)))
    sent = a1111.requests[-1]
    assert sent[1] == "/sdapi/v1/txt2img"
    assert sent[2] | {} == {
        "prompt": "a cat",
        "negative_prompt": "dog",
        "seed": 40,
        "steps": 5,
        "cfg_scale": 6.5,
        "width": 64,
        "height": 64,
        "batch_size": 2,
        "n_iter": 1,
        "sampler_name": "Euler a",
    }
    assert [i.seed for i in made.images] == [40, 41]
    assert made.images[0].png != made.images[1].png
    assert Image.open(io.BytesIO(made.images[0].png)).size == (64, 64)
    assert steps == [(5, 5)]


async def test_img2img_sends_the_init_image_and_strength(a1111: FakeA1111) -> None:
    engine = A1111Engine(a1111.url)
    source = base64.b64encode(b"\x89PNG fake").decode()
    job = ImageJob(prompt="x", width=64, height=64, steps=2, init_image=source, strength=0.3)
    made = await engine.generate(job, 1, lambda d, t: None)
    path, body = a1111.requests[-1][1:]
    assert path == "/sdapi/v1/img2img"
    assert body["init_images"] == [source]
    assert body["denoising_strength"] == 0.3
    assert len(made.images) == 1


async def test_a_server_that_is_down_is_a_clear_error() -> None:
    with FakeA1111.start() as server:
        url = server.url
    with pytest.raises(A1111Error, match="failed"):
        await A1111Engine(url).load()


async def test_the_server_refusing_a_body_is_an_input_error(a1111: FakeA1111) -> None:
    engine = A1111Engine(a1111.url)
    with pytest.raises(ImageInputError):
        await engine._call("POST", "/sdapi/v1/txt2img", {"steps": 1})


def _progress_polls(server: FakeA1111) -> int:
    return sum(path.startswith("/sdapi/v1/progress") for _m, path, _b in server.requests)


async def test_steps_come_from_polling_progress_which_stops_with_the_answer(
    a1111: FakeA1111,
) -> None:
    a1111.step_delay = 0.1
    engine = A1111Engine(a1111.url, progress_interval=0.05)
    steps: list[tuple[int, int]] = []
    job = ImageJob(prompt="a cat", width=64, height=64, steps=6)
    await engine.generate(job, 3, lambda d, t: steps.append((d, t)))
    assert ("GET", "/sdapi/v1/progress?skip_current_image=true", None) in a1111.requests
    assert len({d for d, _t in steps if d < 6}) >= 2  # several steps seen while it ran
    assert steps == sorted(set(steps))  # each step once, in order
    assert all(t == 6 for _d, t in steps)
    assert steps[-1] == (6, 6)
    polls = _progress_polls(a1111)
    await asyncio.sleep(0.3)  # six poll intervals: a poller still running would have asked
    assert _progress_polls(a1111) == polls


@pytest.mark.parametrize(
    ("answer", "last", "expected"),
    [
        ({"state": {"job_count": 1, "sampling_step": 3, "sampling_steps": 20}}, 0, (3, 20)),
        ({"state": {"job_count": 1, "sampling_step": 3, "sampling_steps": 20}}, 3, None),
        ({"state": {"job_count": 0, "sampling_step": 20, "sampling_steps": 20}}, 0, None),
        ({"state": {"job_count": 1, "sampling_step": 0, "sampling_steps": 20}}, 0, None),
        ({"state": {"job_count": 1, "sampling_step": 25, "sampling_steps": 20}}, 0, (20, 20)),
        ({"state": {"job_count": 1, "sampling_step": "x"}}, 0, None),
        ({"progress": 0.5}, 0, None),
        ([], 0, None),
    ],
)
def test_progress_step(answer: object, last: int, expected: tuple[int, int] | None) -> None:
    assert progress_step(answer, last) == expected
