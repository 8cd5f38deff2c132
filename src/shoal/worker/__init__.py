"""The worker: serves models on one machine and takes its jobs from a router (or Redis). Its
rooms, highest first; a room imports only rooms below it (``tests/test_layers.py`` checks it):

* ``main.py``: the composition root: plans what to serve, builds the link, the job runner and
  the shard host, and runs them in one task group (pull mode too). ``service/``: installing
  the worker as a system service (systemd, launchd) instead.
* ``serving.py``: what the worker serves (its text backend, image models, split models) and
  every link told when that changes.
* ``link/`` (how jobs reach the worker: the router link, or Redis in pull mode; the outbox,
  drain) and ``shards/`` (its parts in split models: stages and heads, RPC tunnels, seeding):
  beside each other, never importing one another.
* ``text/`` (text models: planning, the llama-server process, running a job against it,
  slots, resuming a lost answer) and ``images/`` (image models and their engines): beside
  each other.
* ``jobs/``: the running jobs (``JobRunner``) and where their output goes (``JobSink``).
* ``settings.py`` (the one settings object), ``hardware.py`` (the worker's view of its
  machine), ``lifecycle.py`` (a backend's state machine and the gate jobs wait at),
  ``backoff.py``, ``tls.py`` (verifying routers and model stores), ``tasks.py`` (a task group
  held open for tasks started on request): for every room.
"""
