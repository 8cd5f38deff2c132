"""The router: the front door clients call and workers dial. Its rooms, highest first; a room
imports only rooms below it (``tests/test_layers.py`` checks it):

* ``app.py``: the composition root: builds the settings and every component, picks memory
  or Redis for each pluggable part, serves.
* ``routes/``: every HTTP and WebSocket route, and what only routes use (the handlers'
  context, the response relay, the ``/metrics`` snapshot, the dashboard).
* ``admission/`` (who may ask and what: keys, rate limits, request checks, usage, result
  cache), ``async_jobs/`` (``/v1/jobs`` records and the service running them),
  ``deployments/`` (split models: plan, start, heal): beside each other, never importing
  one another.
* ``dispatch/``: the job path, with the workers' connections it places jobs on.
* ``observe/``: the Prometheus metrics the rooms above count into.
* ``settings.py``, ``errors.py``: the router's settings and what it refuses, for every room.
"""
