"""The built-in engine loading a single ``.safetensors`` checkpoint (the original Stable
Diffusion / Automatic1111 layout) offline: the tiny random pipeline's weights, rewritten in that
layout by scripts/make_tiny_sd_pipeline.py, with its configs from a folder holding no weights,
give the same image bytes as the pipeline folder itself. Real diffusers, no Hub."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from shoal.protocol.images import ImageJob
from shoal.worker.images.diffusers_engine import DiffusersEngine, single_file_config
from shoal.worker.images.engine import ImageEngineError
from shoal.worker.images.plan import _engine, plan_images
from shoal.worker.settings import WorkerSettings

SCRIPT = Path(__file__).parents[3] / "scripts" / "make_tiny_sd_pipeline.py"
JOB = ImageJob(prompt="a red cat on a house", width=64, height=64, steps=3)


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tiny_sd_pipeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def single_file(tiny_sd_pipeline: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny.safetensors`` (LDM layout) next to ``configs/``: the pipeline minus its weights."""
    folder = tmp_path_factory.mktemp("single-file")
    checkpoint: Path = _script().to_single_file(tiny_sd_pipeline, folder / "tiny.safetensors")
    ignore = shutil.ignore_patterns("*.safetensors", "*.bin")
    shutil.copytree(tiny_sd_pipeline, folder / "configs", ignore=ignore)
    return checkpoint


async def _image(engine: DiffusersEngine, seed: int) -> bytes:
    steps: list[tuple[int, int]] = []
    made = await engine.generate(JOB, seed, lambda done, total: steps.append((done, total)))
    assert steps[-1] == (3, 3)
    return made.images[0].png


def test_config_rule_prefers_the_flag_then_a_folder_named_like_the_checkpoint(
    tmp_path: Path,
) -> None:
    checkpoint = tmp_path / "v1-5.safetensors"
    assert single_file_config(checkpoint, "org/repo") == "org/repo"
    assert single_file_config(checkpoint, None) is None
    (tmp_path / "v1-5").mkdir()
    assert single_file_config(checkpoint, None) is None  # a folder, but not a pipeline
    (tmp_path / "v1-5" / "model_index.json").write_text("{}")
    assert single_file_config(checkpoint, None) == str(tmp_path / "v1-5")
    assert single_file_config(checkpoint, "/elsewhere") == "/elsewhere"


async def test_checkpoint_with_image_config_gives_the_folder_pipelines_bytes(
    tiny_sd_pipeline: Path, single_file: Path
) -> None:
    configs = single_file.parent / "configs"
    assert not list(configs.rglob("*.safetensors"))  # every weight comes from the checkpoint
    settings = WorkerSettings(image_model=str(single_file), image_config=str(configs))
    (plan,) = plan_images(settings)
    engine = _engine(plan, settings)
    assert isinstance(engine, DiffusersEngine)
    from_folder = DiffusersEngine(tiny_sd_pipeline)
    for seed in (7, 8):
        assert await _image(engine, seed) == await _image(from_folder, seed)
    assert await _image(engine, 7) != await _image(engine, 8)


async def test_a_pipeline_folder_next_to_the_checkpoint_is_the_default(
    single_file: Path, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "model.safetensors"
    shutil.copy(single_file, checkpoint)
    shutil.copytree(single_file.parent / "configs", tmp_path / "model")
    engine = DiffusersEngine(checkpoint)
    await engine.load()
    assert engine.loaded
    assert engine.native_size() == 64


async def test_without_configs_the_error_says_to_pass_image_config(
    single_file: Path, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "lone.safetensors"
    shutil.copy(single_file, checkpoint)
    with pytest.raises(ImageEngineError, match="--image-config"):
        await DiffusersEngine(checkpoint).load()
