"""Exact resumption: an answer a lost worker began goes on here, token for token.

* ``continuation.py`` (pure): ``TokenTrail`` (the token ids a stream's client has), the
  continuation request, ``Splice`` and ``WholeAnswer`` (its output joined to what was sent).
* ``going_on.py``: ``GoingOn``, running a continuation on our own llama-server.
"""
