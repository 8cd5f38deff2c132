"""The body of an image job as router and worker exchange it, and the events it streams.

The router turns an OpenAI request (``/v1/images/generations``, ``/v1/images/edits``) or an
Automatic1111-style one into one ``ImageJob`` (``router/admission/image_requests.py``), checked
against the limits below, and sends ``ImageJob.model_dump()`` as ``JobStart.body``. The worker
reads it back with ``ImageJob.model_validate`` and runs it on its image engine.

A streamed image job sends ``progress_event`` chunks, one per denoising step, then one
``completed_event`` chunk with the result; a non-streamed one answers the result alone.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MIN_SIDE = 64
MAX_SIDE = 2048
SIDE_MULTIPLE = 8
"""Width and height: multiples of 8 (the VAE's downscale), from 64 to 2048 pixels."""
MAX_IMAGES = 8
"""Most images one request makes (``n``, or A1111's ``batch_size``)."""
MAX_STEPS = 150
MAX_CFG_SCALE = 30.0
MAX_SEED = 2**32 - 1
SAMPLERS = (
    "Euler a",
    "Euler",
    "DDIM",
    "DPM++ 2M",
    "DPM++ 2M Karras",
    "Heun",
    "PNDM",
    "UniPC",
)
"""Sampler names (Automatic1111's) every engine accepts; ``None`` keeps the model's own."""

PROGRESS_TYPE = "image_generation.progress"
COMPLETED_TYPE = "image_generation.completed"


class ImageJob(BaseModel):
    """What to generate. ``init_image`` (base64 PNG/JPEG/WebP) makes it img2img."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str
    negative_prompt: str = ""
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    width: int | None = Field(None, ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_MULTIPLE)
    height: int | None = Field(None, ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_MULTIPLE)
    """None: the model's native size."""
    steps: int = Field(20, ge=1, le=MAX_STEPS)
    cfg_scale: float = Field(7.0, ge=0.0, le=MAX_CFG_SCALE)
    sampler: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """None: the worker picks one and reports it. Image ``i`` of ``n`` uses ``seed + i``."""
    strength: float = Field(0.75, gt=0.0, le=1.0)
    """img2img only: how much of the input is replaced (A1111's ``denoising_strength``)."""
    init_image: str | None = None


def seeds_for(seed: int, n: int) -> list[int]:
    """The seed of each image: ``seed``, ``seed + 1``, ... (wrapping at 2**32)."""
    return [(seed + i) % (MAX_SEED + 1) for i in range(n)]


def progress_event(step: int, total_steps: int, image_count: int) -> dict[str, Any]:
    """One streamed progress chunk: ``step`` of ``total_steps`` denoising steps are done."""
    return {
        "type": PROGRESS_TYPE,
        "step": step,
        "total_steps": total_steps,
        "progress": round(step / total_steps, 4) if total_steps else 1.0,
        "images": image_count,
    }


def completed_event(result: dict[str, Any]) -> dict[str, Any]:
    """The last streamed chunk: the whole result, tagged."""
    return {"type": COMPLETED_TYPE, **result}
