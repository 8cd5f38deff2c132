"""What image models a worker serves, decided before it starts, and the parts that serve them.

``plan_images`` resolves each of ``--image-model`` (comma-separated: a folder, a checkpoint, a
Hub repo, downloaded then) or, with ``--image-backend-url`` (an Automatic1111/Forge server),
takes them as its checkpoint names. ``start_images`` builds an engine per model under one
``ImageModels`` (an ``ImageService`` and ``ImageBackend`` each); the engines import their
heavy libraries only when they load a model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.models.errors import ModelError
from shoal.models.hub import HubConfig
from shoal.models.image_resolve import resolve_image_model
from shoal.protocol.ids import ModelName
from shoal.worker.images.engine import ImageEngine
from shoal.worker.images.models import ImageModels, StateCallback
from shoal.worker.settings import WorkerSettings


@dataclass(frozen=True)
class ImagePlan:
    name: ModelName
    path: Path | None = None
    """The diffusers pipeline folder or checkpoint (built-in engine)."""
    backend_url: str | None = None
    """An Automatic1111/Forge server (adapter); ``checkpoint`` is the model it should load."""
    checkpoint: str | None = None


def image_specs(settings: WorkerSettings) -> list[str]:
    return [s.strip() for s in (settings.image_model or "").split(",") if s.strip()]


def plan_images(settings: WorkerSettings) -> list[ImagePlan]:
    """The image models to serve, on disk (downloaded if needed). Blocking."""
    specs = image_specs(settings)
    alias = settings.image_model_alias if len(specs) <= 1 else None
    if settings.image_backend_url:
        url = settings.image_backend_url.rstrip("/")
        if not specs:
            return [ImagePlan(ModelName((alias or "a1111").lower()), backend_url=url)]
        return [
            ImagePlan(ModelName((alias or spec).lower()), backend_url=url, checkpoint=spec)
            for spec in specs
        ]
    hub = HubConfig.from_env(os.environ)  # HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE
    plans = []
    for spec in specs:
        model = resolve_image_model(
            spec, settings.cache_dir, download=not settings.offline, hub=hub
        )
        plans.append(ImagePlan(ModelName(alias or model.id), path=model.path))
    if len({p.name for p in plans}) < len(plans):
        raise ModelError(
            "Two image models have the same name; give them distinct folder or file names."
        )
    return plans


def _engine(plan: ImagePlan, settings: WorkerSettings) -> ImageEngine:
    if plan.backend_url is not None:
        from shoal.worker.images.a1111 import A1111Engine

        return A1111Engine(plan.backend_url, plan.checkpoint)
    from shoal.worker.images.diffusers_engine import DiffusersEngine

    assert plan.path is not None
    return DiffusersEngine(plan.path, settings.image_device, settings.image_config)


def start_images(
    plans: list[ImagePlan],
    settings: WorkerSettings,
    *,
    on_models: Callable[[], None],
    on_state: StateCallback | None,
) -> ImageModels:
    """The worker's image models; ``on_models`` and ``on_state`` as for ``ImageModels``."""
    return ImageModels(
        [(plan.name, _engine(plan, settings)) for plan in plans],
        on_models=on_models,
        on_state=on_state,
        max_loaded=settings.image_max_loaded,
        idle_unload_s=settings.idle_unload,
    )
