"""Per-key rate limits, one Protocol and two siblings chosen once in ``router/app.py``.

* ``interface.py``: ``RateLimiter`` and ``StreamSlot``, the limits, and the pure rules both
  siblings apply (sliding window, GCRA, OpenAI-style headers and refusals).
* ``memory.py``: limits enforced by one router.
* ``redis.py``: limits shared by every router through Redis (falling back to ``memory.py``
  while Redis is down).
"""
