"""Image models: planned at start, loaded and unloaded on demand, each run by an engine.

* ``plan.py``: which image models the worker serves (``--image-model``,
  ``--image-backend-url``), resolved before it starts, and the parts that serve them.
* ``models.py``: ``ImageModels``, several models kept within ``--image-max-loaded`` (which
  one runs a job, what to unload; pure rule ``to_unload``).
* ``service.py``: one image model: its engine, its state machine, idle unload.
* ``backend.py``: runs an image job on an engine and reports it like any other job.
* ``engine.py``: the ``ImageEngine`` protocol; ``diffusers_engine.py`` (a pipeline run here)
  and ``a1111.py`` (an Automatic1111/Forge server attached to) implement it.
"""
