"""The result cache (``--cache``), one Protocol and two siblings chosen once in
``router/app.py``.

* ``interface.py``: what is cacheable and its key (pure), ``CachedAnswer``, ``replay``,
  ``CacheFill`` and the ``ResultCache`` Protocol.
* ``memory.py``: this router's LRU; ``redis.py``: shared by every router through Redis.
"""
