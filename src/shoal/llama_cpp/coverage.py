"""Whether the llama.cpp build that will run drives this machine's GPUs, in words.

A CPU build of llama-server on a machine with GPUs runs, slowly, a model sized for the VRAM it
does not use, and says nothing. :func:`unused_gpus` compares the GPUs the vendor tools found
with the devices the build lists (``llama_cpp.devices``, ``--list-devices``) and says what
is wrong and what fixes it: the worker logs it as a warning at start and reports it at
registration (``Register.gpus_unused``, a badge on the dashboard), and ``shoal doctor`` makes
it an error.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.hardware.profile import GpuDevice
from shoal.llama_cpp.backend import INSTALL, BackendChoice
from shoal.llama_cpp.binaries import Binaries
from shoal.llama_cpp.devices import ComputeDevice

_FROM = {
    "flag": "given with --llama-server-path",
    "path": "found on PATH",
    "cache": "from Shoal's cache",
    "build": "built just now",
    "download": "downloaded just now",
}


def unused_gpus(
    gpus: Sequence[GpuDevice],
    listed: Sequence[ComputeDevice],
    binaries: Binaries,
    choice: BackendChoice | None,
) -> str | None:
    """Why the GPUs here sit idle under ``binaries`` and how to fix it; None when the build
    drives a GPU (or there is none). ``choice``: the backend decision for this machine (None
    when ``--llama-server-path`` made it moot)."""
    if not gpus or listed:
        return None
    names = ", ".join(dict.fromkeys(g.name for g in gpus))
    return (
        f"this machine has {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({names}), but its "
        f"llama-server ({binaries.llama_server}, {_FROM[binaries.source]}) drives none of them "
        f"(`llama-server --list-devices` lists no GPU): models run on the CPU. "
        f"To fix: {_fix(binaries, choice)}"
    )


def _fix(binaries: Binaries, choice: BackendChoice | None) -> str:
    if choice is not None and choice.idle_gpus:  # the backend itself cannot use them
        return choice.idle_gpus
    backend = choice.backend if choice is not None else None
    install = f"`{INSTALL}`" + (f" (it gets llama.cpp's {backend} build)" if backend else "")
    if binaries.source == "flag":
        return (
            "pass a GPU build of llama-server to --llama-server-path, or leave the flag out "
            f"and run {install}"
        )
    if binaries.source == "path":
        return f"run {install}; Shoal's cache comes before PATH"
    return (
        f"run `{binaries.llama_server} --list-devices` to see why its {backend or 'GPU'} "
        f"backend finds no GPU (a driver library it cannot load), or `{INSTALL} "
        "--llama-cpp-backend BACKEND` for another backend"
    )
