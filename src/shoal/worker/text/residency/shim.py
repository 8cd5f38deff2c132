"""Stand-ins for the lead's ``measured.py``, ``budget.py`` and ``models_file.py`` (same
signatures), until they land on main; deleted then.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.hardware.profile import MachineProfile
from shoal.models.residency import Footprint
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.llama_server import LlamaServerConfig

_BUFFER = re.compile(
    r"\b([A-Za-z]+?)(\d*)(_Mapped|_Host|_REPACK)?\s+\w+ buffer size\s*=\s*([\d.]+) MiB"
)
_RAM_DEVICES = frozenset({"CPU"})


def footprint_from_log(lines: Iterable[str]) -> Footprint | None:
    """What llama-server reported on load (its ``... buffer size = X MiB`` lines)."""
    ram = 0
    gpus: dict[int, int] = {}
    found = False
    for line in lines:
        m = _BUFFER.search(line)
        if m is None:
            continue
        found = True
        device, index, kind, mib = m.group(1), m.group(2), m.group(3), float(m.group(4))
        size = int(mib * 2**20)
        if device in _RAM_DEVICES or kind == "_Host" or not index:
            ram += size
        else:
            gpus[int(index)] = gpus.get(int(index), 0) + size
    if not found:
        return None
    n = max(gpus, default=-1) + 1
    return Footprint(ram, tuple(gpus.get(i, 0) for i in range(n)))


def model_budget(machine: MachineProfile, settings: WorkerSettings) -> Footprint:
    """Free RAM / VRAM at start, each capped by ``--memory-budget`` GiB when set."""
    cap = int(settings.memory_budget * 2**30) if settings.memory_budget is not None else None
    ram = machine.ram_available_bytes
    gpus = tuple(g.memory_free_bytes or g.memory_total_bytes for g in machine.gpus)
    if cap is not None:
        ram = min(ram, cap)
        gpus = tuple(min(g, cap) for g in gpus)
    return Footprint(ram, gpus)


def estimate(config: LlamaServerConfig, machine: MachineProfile) -> Footprint:
    """A first-load guess: the file's bytes, in RAM (a CPU worker) or on GPU 0."""
    size = config.model_path.stat().st_size
    if machine.gpus and "none" not in config.device_args:
        return Footprint(0, (size,))
    return Footprint(size)


@dataclass(frozen=True)
class ModelSpec:
    model: str
    alias: str | None = None
    ctx_size: int | None = None
    slots: int | None = None
    llama_server_args: str | None = None
    pinned: bool = False
    preload: bool = False
    idle_unload: float | None = None
    quantization: str | None = None


class ModelsFileError(Exception):
    pass


def load_models_file(path: Path) -> tuple[ModelSpec, ...]:
    """``[[model]]`` tables in TOML (or a ``models:`` list in YAML)."""
    text = path.read_text()
    data: Any
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
        entries = data.get("models", data.get("model", []))
    else:
        data = tomllib.loads(text)
        entries = data.get("model", data.get("models", []))
    specs = []
    for entry in entries:
        if "model" not in entry:
            raise ModelsFileError(f"{path}: an entry has no 'model' key")
        specs.append(ModelSpec(**entry))
    return tuple(specs)
