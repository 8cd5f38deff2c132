"""The jobs running on this worker, whatever serves them.

* ``runner.py``: ``JobRunner``, one task per job in one task group, cancellable by id; a text
  job goes to the worker's backend (or a split model's head), an image job to the image
  models, each known only as a ``JobFunction``.
* ``sink.py``: ``JobSink``, where a job's output goes (the router link's outbox, or Redis).
"""
