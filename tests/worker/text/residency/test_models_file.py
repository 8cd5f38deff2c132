"""``worker/text/residency/models_file.py``: the models file, TOML or YAML, and its mistakes."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.worker.text.residency.models_file import (
    ModelsFileError,
    ModelSpec,
    check_names,
    load_models_file,
)

TOML = """
[[models]]
model = "qwen2.5-0.5b-instruct"
alias = "small"
ctx_size = 8192
slots = 2
pinned = true
preload = true
idle_unload = 600
quantization = "Q4_K_M"
llama_server_args = "--flash-attn on"

[[models]]
model = "/models/other.gguf"
"""

YAML = """
models:
  - model: qwen2.5-0.5b-instruct
    alias: small
    ctx_size: 8192
    slots: 2
    pinned: true
    preload: true
    idle_unload: 600
    quantization: Q4_K_M
    llama_server_args: --flash-attn on
  - model: /models/other.gguf
"""

EXPECTED = (
    ModelSpec(
        model="qwen2.5-0.5b-instruct",
        alias="small",
        ctx_size=8192,
        slots=2,
        llama_server_args="--flash-attn on",
        pinned=True,
        preload=True,
        idle_unload=600.0,
        quantization="Q4_K_M",
    ),
    ModelSpec(model="/models/other.gguf"),
)


@pytest.mark.parametrize(("name", "text"), [("m.toml", TOML), ("m.yaml", YAML), ("m.yml", YAML)])
def test_toml_and_yaml_give_the_same_specs(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert load_models_file(path) == EXPECTED
    assert [s.name for s in EXPECTED] == ["small", "/models/other.gguf"]


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("m.json", "{}", "is .toml, .yaml or .yml"),
        ("m.toml", "[[models]\nmodel=1", "not valid TOML"),
        ("m.yaml", "models: [a: b", "not valid YAML"),
        ("m.toml", 'model = "x"', "one list named 'models'"),
        ("m.yaml", "- model: x", "one list named 'models'"),
        ("m.toml", "models = []", "non-empty list"),
        ("m.yaml", "models:\n  - just-a-name", "model 1: expected a table"),
        (
            "m.toml",
            '[[models]]\nmodel = "a"\npinnned = true',
            "model 1 (a): unknown key(s) pinnned; the keys are model, alias",
        ),
        ("m.toml", '[[models]]\nmodel = "a"\nslots = 0', "model 1 (a): slots: Input should be"),
        ("m.toml", '[[models]]\nmodel = "a"\nctx_size = "big"', "ctx_size: Input should be"),
        ("m.toml", '[[models]]\nalias = "a"', "model 1: model: Field required"),
        (
            "m.toml",
            '[[models]]\nmodel = "a"\n[[models]]\nmodel = "b"\nalias = "a"',
            "models 1 and 2 are both named 'a'; give one an alias",
        ),
    ],
)
def test_mistakes_name_the_file_the_entry_and_the_fix(
    tmp_path: Path, name: str, text: str, says: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ModelsFileError) as caught:
        load_models_file(path)
    assert says in str(caught.value)
    assert str(path) in str(caught.value)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelsFileError, match="cannot read the models file .*No such file"):
        load_models_file(tmp_path / "absent.toml")


def test_names_from_the_command_line_are_checked_too() -> None:
    check_names([ModelSpec("a"), ModelSpec("b")], "--model")
    with pytest.raises(ModelsFileError, match="--model: models 1 and 2 are both named 'a'"):
        check_names([ModelSpec("a"), ModelSpec("a")], "--model")
