"""llama.cpp binaries: the pinned release or source, downloading or building it, finding it.

This package imports nothing on its own, so that importing one of its modules (``errors``,
``options``) does not load the download and build machinery.

Choosing and finding
    ``locate.py`` (which llama-server runs, and why: the entry point), ``backend.py`` +
    ``facts.py`` + ``cuda.py`` (which backend fits this machine, pure rules), ``coverage.py``
    (whether a build drives this machine's GPUs), ``binaries.py``, ``version.py``.
Getting it
    ``release.py`` + ``download.py`` + ``archive.py`` (the prebuilt release), ``source.py`` +
    ``build.py`` (the pinned sdist, built into the cache).
Running it
    ``options.py`` (the options every llama-server shares), ``threads.py`` (CPU threads),
    ``host_servers.py`` (the llama.cpp servers already on this machine), ``devices.py``
    (``--list-devices``), ``load_log.py`` (where a model was placed), ``rpc_cache.py``.
``errors.py``: ``LlamaCppError``.
"""
