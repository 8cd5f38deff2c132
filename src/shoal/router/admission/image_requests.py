"""What an image request may be: OpenAI's or Automatic1111's fields, checked, as one ``ImageJob``.

Pure: ``check_image_request`` takes the request's fields (a JSON body, or the fields of a
``multipart/form-data`` upload, where every value arrives as text) and the image models the
cluster serves, and returns the model, whether to stream, and the ``ImageJob`` body to queue; or
raises a ``BadRequest`` (400) naming the field and what to send instead.

The router does not decode images (it needs no imaging library): it checks that an input image
is base64 of a PNG, JPEG or WebP file by its first bytes; the worker decodes it.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from pydantic import ValidationError

from shoal.protocol.images import MAX_SIDE, MIN_SIDE, SAMPLERS, SIDE_MULTIPLE, ImageJob
from shoal.protocol.messages import Endpoint
from shoal.router.errors import BadRequest

ALIASES = {
    "batch_size": "n",
    "num_inference_steps": "steps",
    "guidance_scale": "cfg_scale",
    "sampler_name": "sampler",
    "denoising_strength": "strength",
}
"""Automatic1111 (and diffusers) names -> Shoal's ``ImageJob`` fields."""
IGNORED = frozenset({"user", "quality", "style", "n_iter", "output_format", "background"})
"""Accepted and not used (OpenAI fields with one possible answer here; A1111's ``n_iter``)."""
_INTS = frozenset({"n", "steps", "seed", "width", "height"})
_FLOATS = frozenset({"cfg_scale", "strength"})
_SIZE = re.compile(r"(\d+)x(\d+)")
_FORMATS = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG"}


@dataclass(frozen=True)
class CheckedImageRequest:
    model: str
    stream: bool
    body: dict[str, Any]
    """``ImageJob.model_dump()``: what the worker gets."""


def image_models(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """The image models served by the workers ``Dispatcher.worker_summaries`` lists."""
    names = {
        str(m["name"])
        for w in summaries
        for m in w.get("models", ())
        if Endpoint.IMAGE_GENERATIONS.value in m.get("endpoints", ())
    }
    return sorted(names)


def _model(fields: Mapping[str, Any], served: Sequence[str]) -> str:
    model = fields.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' must be a non-empty string.", param="model")
        return model
    if len(served) == 1:
        return served[0]
    if not served:
        raise BadRequest(
            "No worker serves an image model yet; start one with `shoal worker --image-model "
            "PATH|ID`.",
            param="model",
            code="model_not_found",
        )
    raise BadRequest(
        f"Several image models are served ({', '.join(served)}); name one in 'model'.",
        param="model",
    )


def _size(fields: dict[str, Any]) -> None:
    """``size: "WxH"`` (OpenAI) -> ``width``/``height``, in place."""
    size = fields.pop("size", None)
    if size is None or size == "auto":
        return
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise BadRequest(
            f"'size' must be WIDTHxHEIGHT, e.g. '512x512' (got {size!r}).", param="size"
        )
    fields["width"], fields["height"] = int(match[1]), int(match[2])


def _check_sides(fields: Mapping[str, Any]) -> None:
    for side in ("width", "height"):
        value = fields.get(side)
        if value is None:
            continue
        if not (
            isinstance(value, int)
            and not isinstance(value, bool)
            and MIN_SIDE <= value <= MAX_SIDE
            and value % SIDE_MULTIPLE == 0
        ):
            raise BadRequest(
                f"'{side}' is {value!r}: image sides must be multiples of {SIDE_MULTIPLE} from "
                f"{MIN_SIDE} to {MAX_SIDE} pixels (e.g. size '512x512').",
                param="size",
            )


def check_input_image(data: object, param: str = "image") -> str:
    """``data`` as the base64 of a PNG, JPEG or WebP file (a ``data:`` URL is unwrapped)."""
    if not isinstance(data, str) or not data:
        raise BadRequest(
            f"'{param}' must be a base64-encoded PNG, JPEG or WebP image.", param=param
        )
    text = data.split(",", 1)[1] if data.startswith("data:") else data
    try:
        head = base64.b64decode(text[:64], validate=True)
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"'{param}' is not valid base64.", param=param) from None
    if not (any(head.startswith(m) for m in _FORMATS) or head[8:12] == b"WEBP"):
        raise BadRequest(
            f"'{param}' is not a PNG, JPEG or WebP image; convert it to PNG and send it again.",
            param=param,
        )
    return text


def _input_image(fields: dict[str, Any], endpoint: Endpoint) -> None:
    if "init_image" in fields:  # the wire name; clients send 'image' (checked here)
        raise BadRequest(
            "Unknown field 'init_image'; send the input image as 'image'.", param="init_image"
        )
    init = fields.pop("init_images", None)
    if init is not None:
        if not isinstance(init, list) or len(init) != 1:
            raise BadRequest("'init_images' must be a list of one image.", param="init_images")
        fields.setdefault("image", init[0])
    image = fields.pop("image", None)
    if fields.pop("mask", None) is not None:
        raise BadRequest(
            "'mask' (inpainting) is not supported; send the image alone for img2img.",
            param="mask",
        )
    if endpoint is Endpoint.IMAGE_EDITS:
        if image is None:
            raise BadRequest("'image' is required for an image edit (img2img).", param="image")
        fields["init_image"] = check_input_image(image)
    elif image is not None:
        raise BadRequest(
            "'image' is for /v1/images/edits (img2img); leave it out of a generation.",
            param="image",
        )
    else:
        fields.pop("strength", None)  # A1111 clients send it with txt2img (for hires fix)


def _renamed(fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields.items():
        name = ALIASES.get(key, key)
        if name in out:
            raise BadRequest(f"Give '{key}' or its alias, not both.", param=key)
        out[name] = value
    return out


def _response_format(fields: dict[str, Any]) -> None:
    fmt = fields.pop("response_format", None)
    if fmt not in (None, "b64_json"):
        raise BadRequest(
            "Only response_format 'b64_json' is supported: Shoal returns images inline and "
            "keeps no files to link to.",
            param="response_format",
        )


def _check_fields(fields: dict[str, Any]) -> None:
    if fields.get("seed") == -1:  # A1111: -1 means "pick one"
        fields["seed"] = None
    sampler = fields.get("sampler")
    if sampler is not None and sampler not in SAMPLERS:
        raise BadRequest(
            f"Unknown sampler {sampler!r}; use one of: {', '.join(SAMPLERS)}.", param="sampler"
        )
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("'prompt' is required: a non-empty string.", param="prompt")


def check_image_request(
    endpoint: Endpoint, raw: Mapping[str, Any], served: Sequence[str]
) -> CheckedImageRequest:
    """The image job ``raw`` asks for, or a 400 naming the field (see the module doc)."""
    fields = _renamed(raw)
    model = _model(fields, served)
    fields.pop("model", None)
    stream = fields.pop("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", param="stream")
    _response_format(fields)
    _size(fields)
    _input_image(fields, endpoint)
    _check_fields(fields)
    for key in IGNORED:
        fields.pop(key, None)
    _check_sides(fields)
    try:
        job = ImageJob.model_validate(fields, strict=True)
    except ValidationError as exc:
        raise _bad(exc) from None
    return CheckedImageRequest(model, stream, job.model_dump())


def _bad(exc: ValidationError) -> BadRequest:
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else "body"
    if first["type"] == "extra_forbidden":
        known = sorted({*ImageJob.model_fields, *ALIASES, "model", "size", "stream", "image"})
        known.remove("init_image")
        return BadRequest(
            f"Unknown field '{field}' for an image request; known fields: {', '.join(known)}.",
            param=field,
        )
    return BadRequest(f"'{field}': {first['msg']}.", param=field)


# ---------------------------------------------------------------- multipart uploads


def form_fields(raw: bytes, content_type: str) -> dict[str, Any]:
    """The fields of a ``multipart/form-data`` body (files as base64), values typed where the
    field is numeric or boolean (a form sends everything as text)."""
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw
    )
    if not message.is_multipart():
        raise BadRequest(
            "The body is not multipart/form-data; send the image as a file upload, or JSON "
            "with the image base64-encoded.",
        )
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        assert isinstance(part, Message)
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        name = name.removesuffix("[]")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        if part.get_filename() is not None:
            if name in fields:
                raise BadRequest("Send one input image; several are not supported.", param=name)
            fields[name] = base64.b64encode(data).decode()
        else:
            fields[name] = _typed(ALIASES.get(name, name), data.decode(errors="replace"))
    return fields


def _typed(name: str, text: str) -> Any:
    try:
        if name in _INTS:
            return int(text)
        if name in _FLOATS:
            return float(text)
    except ValueError:
        raise BadRequest(f"'{name}' must be a number (got {text!r}).", param=name) from None
    if name == "stream":
        if text not in ("true", "false"):
            raise BadRequest("'stream' must be true or false.", param="stream")
        return text == "true"
    return text
