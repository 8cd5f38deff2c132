"""Async jobs (``/v1/jobs``): records, their store and the service that runs them in the
background. The routes are in ``router/routes/jobs.py``.

* ``records.py``: a job's record and its status state machine.
* ``store/``: where records live (``interface.py``: the ``JobStore`` Protocol; ``memory.py``
  and ``redis.py`` siblings, chosen once in ``router/app.py``).
* ``service.py``: ``JobsService``, which owns the running jobs; ``runner.py``: running one
  through the dispatcher.
"""
