"""The models file: the text models one worker serves, with per-model options.

TOML (``.toml``) or YAML (``.yaml``/``.yml``), one list named ``models``::

    # models.toml
    [[models]]
    model = "qwen2.5-0.5b-instruct"   # a catalog id, org/repo[:QUANT], a .gguf path or a store id
    alias = "small"                   # the name clients ask for (default: the model id)
    ctx_size = 8192                   # context per slot, tokens (default: --ctx-size)
    slots = 2                         # requests at once (default: --slots)
    pinned = true                     # never evicted to make room for another model
    preload = true                    # load at start (default: only the first model)
    idle_unload = 600                 # seconds without jobs before it unloads (0: never)
    quantization = "Q4_K_M"           # for a catalog model or a Hugging Face repo
    llama_server_args = "--flash-attn on"

    [[models]]
    model = "/models/other.gguf"

Each entry becomes a ``ModelSpec``; ``--model`` given on the command line (repeatable) makes
specs with only ``model`` set. Mistakes are ``ModelsFileError``s that name the file, the entry
and the key, and say what to write instead.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ModelsFileError(ValueError):
    """The models file cannot be read or says something wrong; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One text model a worker serves, as the operator gave it. None: the worker's default."""

    model: str
    alias: str | None = None
    ctx_size: int | None = None
    slots: int | None = None
    llama_server_args: str | None = None
    pinned: bool = False
    preload: bool | None = None
    """None: preload only the first model the worker names."""
    idle_unload: float | None = None
    quantization: str | None = None

    @property
    def name(self) -> str:
        """The name clients ask for, as far as the file says (the model id without alias)."""
        return self.alias or self.model


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    model: str = Field(min_length=1)
    alias: str | None = Field(None, min_length=1, max_length=256)
    ctx_size: int | None = Field(None, ge=256)
    slots: int | None = Field(None, ge=1, le=4096)
    llama_server_args: str | None = None
    pinned: bool = False
    preload: bool | None = None
    idle_unload: float | None = Field(None, ge=0)
    quantization: str | None = Field(None, min_length=1)


KNOWN_KEYS = tuple(_Entry.model_fields)


def load_models_file(path: Path) -> tuple[ModelSpec, ...]:
    """The specs ``path`` lists, in its order (module docstring)."""
    data = _read(path)
    if not isinstance(data, Mapping) or set(data) != {"models"}:
        raise ModelsFileError(
            f"{path}: expected one list named 'models' (in TOML, [[models]] tables; in YAML, "
            f"'models:' then '- model: …' items); found "
            f"{_keys(data) if isinstance(data, Mapping) else type(data).__name__}"
        )
    entries = data["models"]
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise ModelsFileError(f"{path}: 'models' must be a non-empty list of tables")
    specs = tuple(_spec(path, i, entry) for i, entry in enumerate(entries, start=1))
    check_names(specs, str(path))
    return specs


def check_names(specs: Sequence[ModelSpec], where: str) -> None:
    """Two models under one name could not be told apart: refuse, naming both."""
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs, start=1):
        if spec.name in seen:
            raise ModelsFileError(
                f"{where}: models {seen[spec.name]} and {i} are both named {spec.name!r}; "
                "give one an alias"
            )
        seen[spec.name] = i


def _read(path: Path) -> object:
    suffix = path.suffix.lower()
    if suffix not in {".toml", ".yaml", ".yml"}:
        raise ModelsFileError(f"{path}: a models file is .toml, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelsFileError(f"cannot read the models file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ModelsFileError(f"{path}: not UTF-8 text") from None
    try:
        return tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ModelsFileError(f"{path}: not valid {suffix[1:].upper()}: {exc}") from None


def _spec(path: Path, index: int, entry: object) -> ModelSpec:
    where = f"{path}, model {index}"
    if not isinstance(entry, Mapping):
        raise ModelsFileError(f"{where}: expected a table of keys ({', '.join(KNOWN_KEYS)})")
    if isinstance(entry.get("model"), str):
        where += f" ({entry['model']})"
    unknown = sorted(str(k) for k in entry if k not in KNOWN_KEYS)
    if unknown:
        raise ModelsFileError(
            f"{where}: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(KNOWN_KEYS)}"
        )
    try:
        parsed = _Entry.model_validate(entry)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'entry'}: {e['msg']}" for e in exc.errors()
        )
        raise ModelsFileError(f"{where}: {problems}") from None
    return ModelSpec(**parsed.model_dump())


def _keys(data: Mapping[Any, Any]) -> str:
    return "keys " + ", ".join(repr(k) for k in data) if data else "nothing"
