"""Every route of the router, grouped by resource, and what only routes use.

* ``inference.py`` (chat, completions, embeddings; the raw-ASGI fast path), ``images.py``,
  ``jobs.py`` (``/v1/jobs``), ``models.py``, ``health.py``, ``usage.py``, ``metrics.py``,
  ``deployments.py`` (``/api/v1/pipeline/...``), ``worker_socket.py`` (the workers'
  WebSocket; ``watchdog.py``, one timer per worker that drops it when silent),
  ``dashboard/`` (the static page).
* ``context.py``: ``RouterContext``, what handlers share, built by the composition root.
* ``relay.py``: ``JobResponse``, a job's events to the client (SSE or JSON).
* ``snapshot.py``: the ``/metrics`` gauges, read from the registry, the dispatcher and the
  deployments at scrape time.
* ``common.py``: JSON responses and a request's ``Tenant``.
"""
