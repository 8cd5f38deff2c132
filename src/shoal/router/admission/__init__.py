"""Admission: who is calling, whether they may, and what their request asks for, before a job
is submitted; and charging what it used when it ends.

* ``auth.py``: who is calling (flag and database keys, scopes, the open-on-loopback rule).
* ``accounting.py``: admit a request against its key's limits; charge tokens, usage and
  metrics when it ends.
* ``ratelimit/``: requests/min, tokens/min and stream slots (``interface.py``: the
  ``RateLimiter`` Protocol and the pure rules; ``memory.py`` and ``redis.py`` siblings).
* ``requests.py``, ``image_requests.py``, ``agent_requests.py``: reading and checking a
  request (pure); ``token_limit.py``: the ``--max-tokens-limit`` rule they share.
* ``usage.py``: token counts read from answers, and usage kept from clients that did not ask.
* ``result_cache/``: deterministic requests' answers (``interface.py``: key derivation, the
  ``ResultCache`` Protocol, replay and fill; ``memory.py`` and ``redis.py`` siblings).
"""
