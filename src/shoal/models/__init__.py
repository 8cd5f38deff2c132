"""Models: what Shoal can fetch by name, and turning a name or path into a local GGUF."""

from shoal.models.default import DEFAULT_MODEL, KNOWN_MODELS
from shoal.models.errors import ModelError
from shoal.models.pypi import cached_model, ensure_model
from shoal.models.resolve import LocalModel, resolve_model
from shoal.models.spec import ModelSpec

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "LocalModel",
    "ModelError",
    "ModelSpec",
    "cached_model",
    "ensure_model",
    "resolve_model",
]
