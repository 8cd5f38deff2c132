"""Which image model a worker serves, as something ``diffusers`` can load from disk.

``--image-model`` is a local diffusers pipeline folder (``model_index.json`` inside), a local
single-file checkpoint (``.safetensors``, ``.ckpt``), or a Hugging Face repo id. A repo is
downloaded through the same code as GGUF models (``hub.py``: verified, resumable, into
Shoal's cache), taking only what loading needs: the configs, the tokenizer files, and one copy
of each component's weights (safetensors over pickles, full precision over fp16 variants).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from shoal.models import hub_cache
from shoal.models.errors import ModelError
from shoal.models.gguf_names import RepoFile
from shoal.models.hub import HubConfig, download_repo_files, list_repo_files

log = logging.getLogger(__name__)

PIPELINE_INDEX = "model_index.json"
CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt")
_CONFIG_SUFFIXES = (".json", ".txt", ".model")
"""Configs, tokenizer vocabularies and merges, sentencepiece models."""
_WEIGHT_PREFERENCE = (".safetensors", ".bin")
_SKIPPED_FOLDERS = frozenset({"safety_checker", "feature_extractor"})
"""Not loaded: Shoal runs pipelines without the safety checker's 1.2 GB model."""


@dataclass(frozen=True)
class ImageModel:
    id: str
    """The default public name: the folder, file or repo name."""
    path: Path
    """A pipeline folder or a checkpoint file."""


def looks_local(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or Path(spec).expanduser().exists()


def pipeline_files(files: list[RepoFile]) -> list[RepoFile]:
    """The files of a diffusers repo that loading it needs (pure).

    Per folder: every config/tokenizer file, and the weights in the first format of
    ``_WEIGHT_PREFERENCE`` that the folder has, without ``.fp16.`` variants when a full one
    exists. Root-level checkpoints, ONNX/Flax exports and the safety checker are left out.
    """
    by_folder: dict[str, list[RepoFile]] = {}
    for f in files:
        parts = PurePosixPath(f.path).parts
        if len(parts) == 1 and f.path != PIPELINE_INDEX:
            continue
        folder = parts[0] if len(parts) > 1 else ""
        if folder not in _SKIPPED_FOLDERS:
            by_folder.setdefault(folder, []).append(f)
    chosen: list[RepoFile] = []
    for entries in by_folder.values():
        chosen += [f for f in entries if f.path.endswith(_CONFIG_SUFFIXES)]
        for suffix in _WEIGHT_PREFERENCE:
            weights = [f for f in entries if f.path.endswith(suffix)]
            full = [f for f in weights if ".fp16." not in f.path]
            if weights:
                chosen += full or weights
                break
    return sorted(chosen, key=lambda f: f.path)


def resolve_image_model(
    spec: str, cache_dir: Path, *, download: bool, hub: HubConfig
) -> ImageModel:
    """The model ``spec`` names, on disk (downloading a Hub repo if needed). Blocking."""
    if looks_local(spec):
        return _local(Path(spec).expanduser())
    hub_cache.check_repo_id(spec)
    folder = hub_cache.repo_dir(cache_dir, spec)
    name = spec.split("/")[-1].lower()
    if (folder / PIPELINE_INDEX).is_file() and (not download or hub.offline):
        return ImageModel(name, folder)
    if not download or hub.offline:
        raise ModelError(
            f"The image model {spec} is not in the cache ({folder}) and downloads are off. "
            "Run once online, or pass the path of a pipeline folder."
        )
    listing = list_repo_files(spec, hub)
    if PIPELINE_INDEX not in {f.path for f in listing}:
        raise ModelError(
            f"{spec} is not a diffusers pipeline (no {PIPELINE_INDEX}); pick a diffusers repo, "
            "or download a .safetensors checkpoint and pass its path."
        )
    wanted = pipeline_files(listing)
    log.info("image model %s: %d files to have in the cache", spec, len(wanted))
    return ImageModel(name, download_repo_files(spec, wanted, cache_dir, hub))


def _local(path: Path) -> ImageModel:
    if path.is_dir():
        if not (path / PIPELINE_INDEX).is_file():
            raise ModelError(
                f"{path} is not a diffusers pipeline folder (no {PIPELINE_INDEX}); save one "
                "with pipeline.save_pretrained(folder), or pass a .safetensors checkpoint."
            )
        return ImageModel(path.resolve().name.lower(), path)
    if path.is_file() and path.suffix in CHECKPOINT_SUFFIXES:
        return ImageModel(path.stem.lower(), path)
    if path.is_file():
        raise ModelError(f"{path} is not an image model: expected a folder or a .safetensors file.")
    raise ModelError(f"No image model at {path}: the path does not exist.")
