"""The built-in image engine: a ``diffusers`` pipeline on PyTorch (CUDA when present, else CPU).

``torch`` and ``diffusers`` are imported only when a pipeline is loaded, so a text-only worker
(and an install without the ``image`` extra) never pays for them. A model is a local pipeline
folder (``model_index.json``, as ``save_pretrained`` writes it) or a single ``.safetensors`` /
``.ckpt`` checkpoint in the original Stable Diffusion layout; ``models/image_resolve.py`` turns Hub
ids into such folders first. A checkpoint holds only weights: the architecture comes from a
diffusers pipeline folder (``single_file_config``), so it loads offline when one is at hand.

Generation runs in a thread; the step callback hands progress to the event loop and, once the
job is cancelled, stops the pipeline at its next step (the thread is waited for, so the next job
never shares the pipeline with a stopping one).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import threading
import warnings
from pathlib import Path
from typing import Any

from shoal.protocol.images import ImageJob, seeds_for
from shoal.worker.images.engine import (
    GeneratedImage,
    Generation,
    ImageEngineError,
    ImageInputError,
    StepCallback,
)

log = logging.getLogger(__name__)

SCHEDULERS = {
    "Euler a": ("EulerAncestralDiscreteScheduler", {}),
    "Euler": ("EulerDiscreteScheduler", {}),
    "DDIM": ("DDIMScheduler", {}),
    "DPM++ 2M": ("DPMSolverMultistepScheduler", {}),
    "DPM++ 2M Karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "Heun": ("HeunDiscreteScheduler", {}),
    "PNDM": ("PNDMScheduler", {}),
    "UniPC": ("UniPCMultistepScheduler", {}),
}
"""Automatic1111 sampler names -> diffusers scheduler class and its options."""
MAX_INPUT_PIXELS = 4096 * 4096
"""Largest init image decoded (a decompression bomb is refused before it is expanded)."""


class _Stopped(Exception):
    """Raised inside the pipeline's step callback when the job was cancelled."""


def decode_image(data: str) -> Any:
    """A base64 (or ``data:`` URL) PNG/JPEG/WebP as an RGB PIL image; ``ImageInputError``
    when it is not one."""
    from PIL import Image, UnidentifiedImageError

    text = data.split(",", 1)[1] if data.startswith("data:") else data
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("The input image is not valid base64.") from None
    Image.MAX_IMAGE_PIXELS = MAX_INPUT_PIXELS
    try:
        with Image.open(io.BytesIO(raw)) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ImageInputError(
            f"The input image cannot be read as PNG, JPEG or WebP: {exc}"
        ) from None


def single_file_config(checkpoint: Path, config: str | None) -> str | None:
    """Where the component configs of a single-file ``checkpoint`` come from: ``config`` (a
    diffusers pipeline folder or Hub repo id, ``--image-config``) when given, else a pipeline
    folder next to the checkpoint named like it (``v1-5.safetensors`` and ``v1-5/``), else
    ``None``: diffusers then infers the architecture and fetches its configs from the Hub."""
    if config is not None:
        return config
    sibling = checkpoint.with_suffix("")
    return str(sibling) if (sibling / "model_index.json").is_file() else None


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class DiffusersEngine:
    """One pipeline from ``path``, loaded on ``load`` (and again after ``unload``)."""

    def __init__(self, path: Path, device: str | None = None, config: str | None = None) -> None:
        self.path = path
        self.device = device
        self.config = config
        """``--image-config``: the pipeline folder or repo describing a single-file ``path``."""
        self.backend = "diffusers"
        self._txt2img: Any = None
        self._img2img: Any = None
        self._default_scheduler: Any = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> bool:
        return self._txt2img is not None

    async def load(self) -> None:
        async with self._lock:
            if self._txt2img is None:
                await asyncio.to_thread(self._load)

    async def unload(self) -> None:
        async with self._lock:
            if self._txt2img is not None:
                self._txt2img = self._img2img = self._default_scheduler = None
                await asyncio.to_thread(_free_memory)
                log.info("image model %s unloaded", self.path)

    def _load(self) -> None:
        try:
            import torch
            from diffusers import AutoPipelineForImage2Image, AutoPipelineForText2Image
        except ImportError as exc:
            raise ImageEngineError(
                f"Image generation needs the image extra ({exc}): pip install 'shoal[image]' "
                "(and a torch build for this machine)."
            ) from None
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        # Half precision on CUDA; the default (float32) elsewhere. Passed only when needed:
        # diffusers renamed the argument (torch_dtype -> dtype) and warns on the old name.
        options = {"torch_dtype": torch.float16} if device == "cuda" else {}
        try:
            if self.path.is_dir():
                pipe = AutoPipelineForText2Image.from_pretrained(  # type: ignore[no-untyped-call]  # diffusers is untyped
                    self.path, **options
                )
            else:
                pipe = self._load_single_file(options)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ImageEngineError(f"Cannot load the image model {self.path}: {exc}") from exc
        pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        self._txt2img = pipe
        self._img2img = AutoPipelineForImage2Image.from_pipe(pipe)
        self._img2img.set_progress_bar_config(disable=True)
        self._default_scheduler = pipe.scheduler
        log.info("image model %s loaded on %s (%s)", self.path, device, type(pipe).__name__)

    def _load_single_file(self, options: dict[str, Any]) -> Any:
        from diffusers import StableDiffusionPipeline

        config = single_file_config(self.path, self.config)
        if config is None:
            try:
                return StableDiffusionPipeline.from_single_file(str(self.path), **options)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                # The inferred configs are on the Hub (out of reach offline), or do not fit.
                raise ImageEngineError(
                    f"Cannot load the image model {self.path}: a checkpoint holds only weights, "
                    f"and the architecture diffusers inferred for it (configs from the Hugging "
                    f"Face Hub) failed: {exc}. Pass --image-config with a diffusers pipeline "
                    f"folder (its JSON files are enough) or repo id of the same architecture, "
                    f"or put that folder next to it as {self.path.with_suffix('')}/."
                ) from exc
        local = Path(config).is_dir()
        log.info("image model %s: configs from %s", self.path, config)
        return StableDiffusionPipeline.from_single_file(
            str(self.path), config=config, local_files_only=local, **options
        )

    def native_size(self) -> int:
        pipe = self._txt2img
        return int(pipe.unet.config.sample_size * pipe.vae_scale_factor)

    async def generate(self, job: ImageJob, seed: int, on_step: StepCallback) -> Generation:
        init = decode_image(job.init_image) if job.init_image is not None else None
        await self.load()
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def step(done: int, total: int) -> None:
            loop.call_soon_threadsafe(on_step, done, total)

        async with self._lock:
            if self._txt2img is None:
                raise ImageEngineError("The image model was unloaded; send the job again.")
            work = asyncio.ensure_future(
                asyncio.to_thread(self._generate, job, seed, init, step, stop)
            )
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                stop.set()  # the pipeline stops at its next step; wait so the lock means idle
                await asyncio.wait([work])
                raise

    def _generate(
        self, job: ImageJob, seed: int, init: Any, step: StepCallback, stop: threading.Event
    ) -> Generation:
        import torch

        pipe = self._img2img if init is not None else self._txt2img
        pipe.scheduler = self._scheduler(job.sampler)
        width, height = self._size(job, init)
        seeds = seeds_for(seed, job.n)
        generators = [torch.Generator().manual_seed(s) for s in seeds]

        def on_step_end(p: Any, index: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if stop.is_set():
                raise _Stopped
            step(index + 1, int(p.num_timesteps))
            return kwargs

        args: dict[str, Any] = {
            "prompt": [job.prompt] * job.n,
            "negative_prompt": [job.negative_prompt] * job.n if job.negative_prompt else None,
            "num_inference_steps": job.steps,
            "guidance_scale": job.cfg_scale,
            "generator": generators,
            "callback_on_step_end": on_step_end,
        }
        if init is not None:
            args |= {"image": init.resize((width, height)), "strength": job.strength}
        else:
            args |= {"width": width, "height": height}
        try:
            images = pipe(**args).images
        except (ValueError, RuntimeError) as exc:
            raise ImageEngineError(f"The pipeline failed: {exc}") from exc
        parameters = {
            "width": width,
            "height": height,
            "steps": job.steps,
            "cfg_scale": job.cfg_scale,
            "sampler": job.sampler or type(self._default_scheduler).__name__,
        }
        made = tuple(GeneratedImage(_png(img), s) for img, s in zip(images, seeds, strict=True))
        return Generation(made, parameters)

    def _size(self, job: ImageJob, init: Any) -> tuple[int, int]:
        """The job's size; else the input image's (img2img), else the model's native size."""
        if init is not None:
            native = (max(64, init.width // 8 * 8), max(64, init.height // 8 * 8))
        else:
            native = (self.native_size(), self.native_size())
        return job.width or native[0], job.height or native[1]

    def _scheduler(self, sampler: str | None) -> Any:
        if sampler is None:
            return self._default_scheduler
        if sampler not in SCHEDULERS:
            raise ImageInputError(
                f"Unknown sampler {sampler!r}; use one of: {', '.join(SCHEDULERS)}."
            )
        import diffusers

        name, options = SCHEDULERS[sampler]
        with warnings.catch_warnings():  # numpy/torch deprecation noise from inside diffusers
            warnings.simplefilter("ignore", DeprecationWarning)
            cls = getattr(diffusers, name)
            return cls.from_config(self._default_scheduler.config, **options)


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
