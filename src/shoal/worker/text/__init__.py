"""Text models: what the worker serves and how, from its plan to each job's last token.

* ``plan.py``: the text model and llama-server's exact configuration, decided before
  anything starts (model file resolved, threads, devices).
* ``llama_server.py``: llama-server as a supervised process (a state machine: load, restart,
  idle unload); ``stall.py``: when it is taken for hung (pure). ``attached.py``: a server we
  did not start, watched.
* ``backend.py``: runs one job against the backend (``Backend``, ``BackendTarget``);
  ``streams.py``: reading its answer and passing it on; ``loopback.py``: the HTTP pool to it;
  ``typed_streams.py`` (Responses, Messages), ``aggregate.py`` (a streamed answer made
  whole), ``backend_errors.py``: pure.
* ``slots.py`` (what each slot holds; pure choice) and ``pinning.py`` (each job pinned to a
  slot by its content).
* ``resume/``: exact resumption of an answer a lost worker began: ``continuation.py`` (which
  tokens the client has, the request that goes on; pure) and ``going_on.py`` (running it).
* ``residency/``: several text models on one worker; ``kv_saves.py``: a model's slots' KV
  caches saved before it is evicted and put back when it loads again.
"""
