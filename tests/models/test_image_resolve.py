"""Which files of a diffusers repo an image worker downloads, and local image model paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.models.errors import ModelError
from shoal.models.gguf_names import RepoFile
from shoal.models.hub import HubConfig
from shoal.models.image_resolve import pipeline_files, resolve_image_model


def _files(*paths: str) -> list[RepoFile]:
    return [RepoFile(p, 1) for p in paths]


def test_pipeline_files_take_configs_and_one_copy_of_each_weight() -> None:
    listing = _files(
        "model_index.json",
        "README.md",
        "v1-5-pruned.safetensors",
        "v1-5-pruned.ckpt",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "unet/diffusion_pytorch_model.bin",
        "vae/config.json",
        "vae/diffusion_pytorch_model.bin",
        "text_encoder/config.json",
        "text_encoder/model.fp16.safetensors",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer_config.json",
        "scheduler/scheduler_config.json",
        "safety_checker/config.json",
        "safety_checker/model.safetensors",
        "feature_extractor/preprocessor_config.json",
    )
    assert [f.path for f in pipeline_files(listing)] == [
        "model_index.json",
        "scheduler/scheduler_config.json",
        "text_encoder/config.json",
        "text_encoder/model.fp16.safetensors",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer_config.json",
        "tokenizer/vocab.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.bin",
    ]


def test_local_folders_and_checkpoints(tmp_path: Path) -> None:
    hub = HubConfig.from_env({})
    folder = tmp_path / "My-Pipe"
    folder.mkdir()
    with pytest.raises(ModelError, match="model_index.json"):
        resolve_image_model(str(folder), tmp_path, download=False, hub=hub)
    (folder / "model_index.json").write_text("{}")
    model = resolve_image_model(str(folder), tmp_path, download=False, hub=hub)
    assert (model.id, model.path) == ("my-pipe", folder)
    ckpt = tmp_path / "DreamShaper.safetensors"
    ckpt.write_bytes(b"x")
    assert resolve_image_model(str(ckpt), tmp_path, download=False, hub=hub).id == "dreamshaper"
    with pytest.raises(ModelError, match="does not exist"):
        resolve_image_model(str(tmp_path / "gone"), tmp_path, download=False, hub=hub)


def test_a_repo_not_in_the_cache_with_downloads_off_says_what_to_do(tmp_path: Path) -> None:
    hub = HubConfig.from_env({})
    with pytest.raises(ModelError, match="not in the cache"):
        resolve_image_model("org/some-sd", tmp_path, download=False, hub=hub)


def test_a_hub_repo_is_downloaded_like_gguf_files_and_loads(
    tmp_path: Path, tiny_sd_pipeline: Path
) -> None:
    """Through a FAKE Hub on loopback (same HTTP calls as huggingface.co), then diffusers
    loads the downloaded folder."""
    from diffusers import AutoPipelineForText2Image

    from fakes.fake_hub import FakeHub

    repo = "shoal-test/tiny-sd"
    files = {
        (repo, p.relative_to(tiny_sd_pipeline).as_posix()): p
        for p in tiny_sd_pipeline.rglob("*")
        if p.is_file()
    }
    files[(repo, "safety_checker/model.safetensors")] = b"not wanted"
    with FakeHub.start(files) as hub:
        model = resolve_image_model(repo, tmp_path, download=True, hub=HubConfig(hub.url))
    assert model.id == "tiny-sd"
    assert (model.path / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert not (model.path / "safety_checker").exists()
    pipe = AutoPipelineForText2Image.from_pretrained(model.path)  # type: ignore[no-untyped-call]
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    offline = resolve_image_model(repo, tmp_path, download=True, hub=HubConfig(offline=True))
    assert offline.path == model.path
