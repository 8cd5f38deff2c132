"""Where async jobs' records live, one Protocol and two siblings chosen once in
``router/app.py``.

* ``interface.py``: ``JobStore`` and the errors it raises.
* ``memory.py``: this router's memory; ``redis.py``: shared by every router through Redis
  (cancellations reach the router running the job by pub/sub).
"""
