"""The Responses API's stored responses (``store: true``, ``previous_response_id``).

* ``store/``: where they live, one layout like every memory/Redis pair: ``interface.py``
  (``ResponseStore``, ``StoredResponse``), ``memory.py``, ``redis.py``.
* ``follow_ups.py``: what is stored of an answer, and a follow-up made whole from the
  conversation it names (pure but for the store's calls).
"""
