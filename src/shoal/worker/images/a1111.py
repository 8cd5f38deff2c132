"""The adapter image engine: an Automatic1111/Forge-compatible server this worker attaches to.

It speaks the server's ``/sdapi/v1`` API: ``sd-models`` to check the server is up and has the
checkpoint asked for, ``options`` to switch to it, ``txt2img`` and ``img2img`` to generate.
The server runs its own model and memory (``unload`` is a no-op here). While a generation
runs, ``progress`` (polled, as A1111 offers nothing else) reports its steps like the built-in
engine does; a server without that endpoint just reports the job done at the end.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from shoal.protocol.images import ImageJob, seeds_for
from shoal.worker.images.engine import (
    GeneratedImage,
    Generation,
    ImageEngineError,
    ImageInputError,
    StepCallback,
)

log = logging.getLogger(__name__)

DEFAULT_SIDE = 512
"""Width and height sent when the job names none (the servers' own default)."""
TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=None)
PROGRESS_PATH = "/sdapi/v1/progress?skip_current_image=true"
PROGRESS_INTERVAL_S = 0.5
"""How often a running generation's progress is asked for."""


class A1111Error(ImageEngineError):
    status = 502
    code = "image_backend_error"


def progress_step(answer: Any, last: int) -> tuple[int, int] | None:
    """``(step, steps)`` from a ``/sdapi/v1/progress`` answer when it shows a running job past
    step ``last``; else ``None``. An idle server keeps the previous job's step counts, so only
    a server with a job (``job_count > 0``) counts."""
    state = answer.get("state") if isinstance(answer, dict) else None
    if not isinstance(state, dict):
        return None
    try:
        jobs, step, steps = (
            int(state.get(k) or 0) for k in ("job_count", "sampling_step", "sampling_steps")
        )
    except (TypeError, ValueError):
        return None
    step = min(step, steps)
    return (step, steps) if jobs > 0 and step > last else None


@dataclass
class _Steps:
    """The steps reported so far for one generation."""

    on_step: StepCallback
    done: int = 0
    total: int = 0

    def report(self, step: int, steps: int) -> None:
        self.done, self.total = step, steps
        self.on_step(step, steps)


class A1111Engine:
    def __init__(
        self,
        url: str,
        checkpoint: str | None = None,
        progress_interval: float = PROGRESS_INTERVAL_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.checkpoint = checkpoint
        self.backend = f"a1111 {self.url}"
        self.progress_interval = progress_interval
        self._loaded = False

    @property
    def loaded(self) -> bool:
        return self._loaded

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.url + path
        try:
            async with (
                aiohttp.ClientSession(timeout=TIMEOUT) as session,
                session.request(method, url, json=body) as resp,
            ):
                raw = await resp.read()
                if resp.status == 422:
                    raise ImageInputError(f"The image server refused the job: {_detail(raw)}")
                if resp.status != 200:
                    raise A1111Error(f"{method} {url} answered {resp.status}: {_detail(raw)}")
                return orjson.loads(raw)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise A1111Error(f"The image server at {self.url} failed: {exc!r}") from None

    async def models(self) -> list[str]:
        """The checkpoints the server has (their titles and model names)."""
        listed = await self._call("GET", "/sdapi/v1/sd-models")
        names: list[str] = []
        for entry in listed if isinstance(listed, list) else []:
            names += [str(entry[k]) for k in ("title", "model_name") if k in entry]
        return names

    async def load(self) -> None:
        names = await self.models()
        if self.checkpoint is not None:
            if self.checkpoint not in names:
                raise A1111Error(
                    f"The image server at {self.url} has no checkpoint {self.checkpoint!r}; "
                    f"it has: {', '.join(names) or 'none'}."
                )
            options = await self._call("GET", "/sdapi/v1/options")
            if options.get("sd_model_checkpoint") != self.checkpoint:
                log.info("image server %s: switching to %s", self.url, self.checkpoint)
                await self._call(
                    "POST", "/sdapi/v1/options", {"sd_model_checkpoint": self.checkpoint}
                )
        self._loaded = True

    async def unload(self) -> None:
        self._loaded = False

    async def generate(self, job: ImageJob, seed: int, on_step: StepCallback) -> Generation:
        payload: dict[str, Any] = {
            "prompt": job.prompt,
            "negative_prompt": job.negative_prompt,
            "seed": seed,
            "steps": job.steps,
            "cfg_scale": job.cfg_scale,
            "width": job.width or DEFAULT_SIDE,
            "height": job.height or DEFAULT_SIDE,
            "batch_size": job.n,
            "n_iter": 1,
        }
        if job.sampler is not None:
            payload["sampler_name"] = job.sampler
        path = "/sdapi/v1/txt2img"
        if job.init_image is not None:
            path = "/sdapi/v1/img2img"
            payload |= {"init_images": [job.init_image], "denoising_strength": job.strength}
        steps = _Steps(on_step)
        async with self._watching(steps):
            answer = await self._call("POST", path, payload)
        images = answer.get("images") if isinstance(answer, dict) else None
        if not isinstance(images, list) or len(images) < job.n:
            raise A1111Error(f"The image server sent {len(images or [])} image(s), not {job.n}.")
        total = steps.total or job.steps  # img2img runs fewer steps than asked (strength)
        if steps.done < total:
            steps.report(total, total)
        seeds = seeds_for(seed, job.n)
        made = tuple(
            GeneratedImage(_png(b64), s) for b64, s in zip(images[: job.n], seeds, strict=True)
        )
        used = {k: payload[k] for k in ("width", "height", "steps", "cfg_scale")}
        used["sampler"] = job.sampler or answer.get("parameters", {}).get("sampler_name")
        return Generation(made, used)

    @contextlib.asynccontextmanager
    async def _watching(self, steps: _Steps) -> AsyncIterator[None]:
        """Poll the server's progress while the body runs; stop (and wait) as it ends."""
        watcher = asyncio.ensure_future(self._poll_progress(steps))
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.wait([watcher])

    async def _poll_progress(self, steps: _Steps) -> None:
        # Polling, against the house rule: A1111 reports a generation's progress only when
        # asked (GET /sdapi/v1/progress; no stream, no push), and the txt2img call itself
        # says nothing until the images are done. The call's end cancels this loop.
        while True:
            await asyncio.sleep(self.progress_interval)
            try:
                answer = await self._call("GET", PROGRESS_PATH)
            except ImageEngineError as exc:  # progress is a nicety: the job goes on without
                log.info("image server %s: no progress (%s); steps jump to done", self.url, exc)
                return
            step = progress_step(answer, steps.done)
            if step is not None:
                steps.report(*step)


def _png(b64: str) -> bytes:
    try:
        return base64.b64decode(b64.split(",", 1)[-1], validate=True)
    except (binascii.Error, ValueError):
        raise A1111Error("The image server sent an image that is not base64.") from None


def _detail(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode(errors="replace")[:300]
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("error") or body)[:300]
    return str(body)[:300]
