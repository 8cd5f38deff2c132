"""Runs image jobs on an ``ImageEngine`` and reports them like any other job.

The job body is an ``ImageJob`` (``protocol/images.py``). A streamed job sends one progress
chunk per denoising step and then the result as its last chunk; a non-streamed one sends the
result alone. The result is OpenAI's images response (``created``, ``data[].b64_json``) plus
what was used: ``seed`` (the first image's; image ``i`` has ``seed + i``, also in its entry)
and ``parameters``.
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
from typing import Any

import orjson
from pydantic import ValidationError

from shoal.protocol.images import MAX_SEED, ImageJob, completed_event, progress_event
from shoal.protocol.messages import ErrorBody, JobDone, JobFailed, JobResult, JobStart
from shoal.worker.images.engine import Generation, ImageEngine, ImageEngineError
from shoal.worker.jobs.sink import JobSink

log = logging.getLogger(__name__)


def result_body(model: str, job: ImageJob, seed: int, made: Generation) -> dict[str, Any]:
    """The answer to an image job (pure)."""
    parameters: dict[str, Any] = {
        "prompt": job.prompt,
        "negative_prompt": job.negative_prompt,
        "n": job.n,
        "seed": seed,
        "steps": job.steps,
        "cfg_scale": job.cfg_scale,
        "sampler": job.sampler,
        **made.parameters,
    }
    if job.init_image is not None:
        parameters["strength"] = job.strength
    return {
        "created": int(time.time()),
        "model": model,
        "data": [
            {"b64_json": base64.b64encode(image.png).decode(), "seed": image.seed}
            for image in made.images
        ],
        "seed": seed,
        "parameters": parameters,
    }


def _failed(job: JobStart, status: int, message: str, code: str, started: bool) -> JobFailed:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JobFailed(
        job_id=job.job_id,
        status=status,
        started=started,
        error=ErrorBody(message=message, type=kind, code=code),
    )


class ImageBackend:
    """The ``JobBackend`` for the image endpoints of one model."""

    def __init__(self, model: str, engine: ImageEngine) -> None:
        self.model = model
        self.engine = engine

    async def run(self, job: JobStart, out: JobSink) -> None:
        try:
            request = ImageJob.model_validate(job.body)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            out.send(_failed(job, 400, f"Bad image job: {problems}", "invalid_image_job", False))
            return
        seed = request.seed if request.seed is not None else secrets.randbelow(MAX_SEED + 1)
        steps_sent = 0

        def on_step(done: int, total: int) -> None:
            nonlocal steps_sent
            if job.stream:
                event = progress_event(done, total, request.n)
                out.chunk(job.job_id, orjson.dumps(event).decode())
                steps_sent += 1

        started = time.monotonic()
        try:
            made = await self.engine.generate(request, seed, on_step)
        except ImageEngineError as exc:
            log.warning("job %s model=%s: image engine: %s", job.job_id, self.model, exc)
            out.send(_failed(job, exc.status, str(exc), exc.code, steps_sent > 0))
            return
        log.info(
            "job %s model=%s: %d image(s), seed %d, in %.2f s",
            job.job_id,
            self.model,
            len(made.images),
            seed,
            time.monotonic() - started,
        )
        body = result_body(self.model, request, seed, made)
        if job.stream:
            out.chunk(job.job_id, orjson.dumps(completed_event(body)).decode())
            out.send(JobDone(job_id=job.job_id))
        else:
            out.send(JobResult(job_id=job.job_id, body=orjson.dumps(body).decode()))
