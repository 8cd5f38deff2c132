"""What every image engine offers the worker: one ``ImageEngine`` protocol and its types.

Two engines implement it: ``DiffusersEngine`` (``diffusers_engine.py``: a pipeline run here on
PyTorch) and ``A1111Engine`` (``a1111.py``: an Automatic1111/Forge-compatible server the
worker attaches to). ``ImageBackend`` (``backend.py``) runs jobs on either.

An engine runs one generation at a time (it holds a lock while it does); ``generate`` reports
each finished denoising step through ``on_step`` on the event loop, and stops when cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoal.protocol.images import ImageJob

StepCallback = Callable[[int, int], None]
"""``on_step(done, total)``: ``done`` of ``total`` denoising steps have finished."""


class ImageEngineError(Exception):
    """The engine could not run a job (or load its model); the job fails with a 5xx."""

    status = 500
    code = "image_engine_error"


class ImageInputError(ImageEngineError):
    """The job asks for something this engine or model cannot do; the client gets a 400."""

    status = 400
    code = "invalid_image_request"


@dataclass(frozen=True)
class GeneratedImage:
    png: bytes
    seed: int


@dataclass(frozen=True)
class Generation:
    """What ``generate`` made, and the parameters it really used."""

    images: tuple[GeneratedImage, ...]
    parameters: dict[str, Any] = field(default_factory=dict)
    """Width, height, steps, sampler, ... as the engine applied them (defaults filled in)."""


class ImageEngine(Protocol):
    backend: str
    """Shown to operators: ``diffusers (cpu)``, ``a1111 http://...``."""

    @property
    def loaded(self) -> bool: ...

    async def load(self) -> None:
        """Load the model (no-op when loaded). Raises ``ImageEngineError``."""

    async def unload(self) -> None:
        """Free the model's memory (no-op when not loaded)."""

    async def generate(self, job: ImageJob, seed: int, on_step: StepCallback) -> Generation:
        """Run ``job`` with ``seed`` (image ``i`` uses ``seed + i``). Raises
        ``ImageInputError`` for a job this model cannot do, ``ImageEngineError`` otherwise."""
