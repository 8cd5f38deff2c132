"""A FAKE NVML (``pynvml.py`` here) and what a test needs to give it to a worker process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).parent
DEFAULT_MACHINE = FOLDER / "h100x2.json"


def worker_env(machine: Path = DEFAULT_MACHINE) -> dict[str, str]:
    """Environment for a worker process whose ``import pynvml`` finds the fake, serving
    ``machine``: this folder first on its ``PYTHONPATH``."""
    paths = [str(FOLDER), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths), "FAKE_NVML_MACHINE": str(machine)}


def machine_gpus(machine: Path = DEFAULT_MACHINE) -> list[dict[str, Any]]:
    """The GPUs of a machine file, as written (MiB, watts, as nvidia-smi shows them)."""
    gpus: list[dict[str, Any]] = json.loads(machine.read_text(encoding="utf-8"))["gpus"]
    return gpus
