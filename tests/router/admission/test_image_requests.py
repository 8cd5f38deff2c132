"""The pure checks of image requests: OpenAI and Automatic1111 fields become one ImageJob,
and every mistake is a 400 naming its field."""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.protocol.images import ImageJob
from shoal.protocol.messages import Endpoint
from shoal.router.admission.image_requests import check_image_request, form_fields, image_models
from shoal.router.errors import BadRequest

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 32).decode()
WEBP = base64.b64encode(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 32).decode()
GEN, EDIT = Endpoint.IMAGE_GENERATIONS, Endpoint.IMAGE_EDITS


def check(body: dict[str, Any], endpoint: Endpoint = GEN, served: tuple[str, ...] = ("sd",)):  # type: ignore[no-untyped-def]
    return check_image_request(endpoint, body, served)


def test_openai_fields_become_an_image_job() -> None:
    checked = check({"prompt": "cat", "size": "512x768", "n": 2, "response_format": "b64_json"})
    assert checked.model == "sd"
    assert checked.stream is False
    job = ImageJob.model_validate(checked.body)
    assert (job.width, job.height, job.n, job.init_image) == (512, 768, 2, None)


def test_a1111_names_are_aliases() -> None:
    body = {
        "prompt": "cat",
        "batch_size": 3,
        "sampler_name": "Euler a",
        "cfg_scale": 5,
        "seed": -1,
        "denoising_strength": 0.4,
        "init_images": [PNG],
        "n_iter": 1,
    }
    job = ImageJob.model_validate(check(body, EDIT).body)
    assert (job.n, job.sampler, job.cfg_scale, job.seed, job.strength) == (
        3,
        "Euler a",
        5,
        None,
        0.4,
    )
    assert job.init_image == PNG


@pytest.mark.parametrize("image", [PNG, JPEG, WEBP, "data:image/png;base64," + PNG])
def test_edits_take_png_jpeg_and_webp(image: str) -> None:
    assert check({"prompt": "x", "image": image}, EDIT).body["init_image"] is not None


@pytest.mark.parametrize(
    ("body", "endpoint", "param"),
    [
        ({"prompt": "x", "size": "100x100"}, GEN, "size"),
        ({"prompt": "x", "size": "32x32"}, GEN, "size"),
        ({"prompt": "x", "width": 64.5}, GEN, "size"),
        ({"prompt": "x", "width": True}, GEN, "size"),
        ({"prompt": "  "}, GEN, "prompt"),
        ({"size": "64x64"}, GEN, "prompt"),
        ({"prompt": "x", "n": 9}, GEN, "n"),
        ({"prompt": "x", "n": True}, GEN, "n"),
        ({"prompt": "x", "steps": 0}, GEN, "steps"),
        ({"prompt": "x", "seed": 2**40}, GEN, "seed"),
        ({"prompt": "x", "cfg_scale": 99}, GEN, "cfg_scale"),
        ({"prompt": "x", "sampler": "Magic"}, GEN, "sampler"),
        ({"prompt": "x", "stream": "yes"}, GEN, "stream"),
        ({"prompt": "x", "response_format": "url"}, GEN, "response_format"),
        ({"prompt": "x", "colour": "red"}, GEN, "colour"),
        ({"prompt": "x", "n": 2, "batch_size": 2}, GEN, "batch_size"),
        ({"prompt": "x", "image": PNG}, GEN, "image"),
        ({"prompt": "x"}, EDIT, "image"),
        ({"prompt": "x", "image": "@@@"}, EDIT, "image"),
        ({"prompt": "x", "image": base64.b64encode(b"GIF89a....").decode()}, EDIT, "image"),
        ({"prompt": "x", "image": PNG, "strength": 0}, EDIT, "strength"),
        ({"prompt": "x", "image": PNG, "strength": 1.5}, EDIT, "strength"),
        ({"prompt": "x", "image": PNG, "mask": PNG}, EDIT, "mask"),
        ({"prompt": "x", "init_images": [PNG, PNG]}, EDIT, "init_images"),
        ({"prompt": "x", "model": ""}, GEN, "model"),
    ],
)
def test_mistakes_are_400s_naming_the_field(
    body: dict[str, Any], endpoint: Endpoint, param: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        check(body, endpoint)
    assert caught.value.param == param


def test_the_model_defaults_to_the_only_image_model() -> None:
    assert check({"prompt": "x"}, served=("only",)).model == "only"
    assert check({"prompt": "x", "model": "b"}, served=("a", "b")).model == "b"
    with pytest.raises(BadRequest, match="Several image models"):
        check({"prompt": "x"}, served=("a", "b"))
    with pytest.raises(BadRequest, match="No worker serves an image model"):
        check({"prompt": "x"}, served=())


def test_image_models_are_read_from_worker_summaries() -> None:
    summaries = [
        {"models": [{"name": "chat", "endpoints": ["chat", "completions"]}]},
        {"models": [{"name": "sd", "endpoints": ["image_generations", "image_edits"]}]},
        {"models": [{"name": "sd", "endpoints": ["image_generations", "image_edits"]}]},
    ]
    assert image_models(summaries) == ["sd"]


def test_multipart_uploads_are_read_with_typed_fields() -> None:
    boundary = "xyz"
    parts = [
        ('name="prompt"', b"a cat"),
        ('name="n"', b"2"),
        ('name="strength"', b"0.5"),
        ('name="stream"', b"true"),
        ('name="image"; filename="in.png"', b"\x89PNG\r\n\x1a\nrest"),
    ]
    raw = (
        b"".join(
            f"--{boundary}\r\nContent-Disposition: form-data; {d}\r\n\r\n".encode() + v + b"\r\n"
            for d, v in parts
        )
        + f"--{boundary}--\r\n".encode()
    )
    fields = form_fields(raw, f"multipart/form-data; boundary={boundary}")
    assert fields == {
        "prompt": "a cat",
        "n": 2,
        "strength": 0.5,
        "stream": True,
        "image": base64.b64encode(b"\x89PNG\r\n\x1a\nrest").decode(),
    }
    with pytest.raises(BadRequest) as caught:
        form_fields(
            raw.replace(b"\r\n2\r\n", b"\r\ntwo\r\n"), f"multipart/form-data; boundary={boundary}"
        )
    assert caught.value.param == "n"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_KEYS = st.sampled_from(
    [
        "prompt",
        "n",
        "size",
        "seed",
        "image",
        "init_images",
        "strength",
        "sampler",
        "stream",
        "model",
        "steps",
        "cfg_scale",
        "width",
        "height",
        "batch_size",
        "mask",
        "response_format",
    ]
)


@given(
    st.dictionaries(_KEYS | st.text(max_size=10), _JSON, max_size=8), st.sampled_from([GEN, EDIT])
)
def test_any_json_body_is_checked_or_refused_with_a_400(
    body: dict[str, Any], endpoint: Endpoint
) -> None:
    try:
        checked = check_image_request(endpoint, body, ("sd",))
    except BadRequest:
        return
    ImageJob.model_validate(checked.body)


@given(st.binary(max_size=300), st.sampled_from(["b", "", "x y", "--"]))
def test_any_multipart_body_is_read_or_refused_with_a_400(raw: bytes, boundary: str) -> None:
    with contextlib.suppress(BadRequest):
        form_fields(b"--b\r\n" + raw, f"multipart/form-data; boundary={boundary}")
