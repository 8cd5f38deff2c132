"""What a job's outcome is, in words both queues share (the router's in-process one and the
Redis one) and a pull-mode worker uses too. Pure; imports only ``protocol``.

* ``events.py``: a job's outcome events (output, hand-offs, the end), mapped from the wire
  in one place and encoded as compact JSON on the Redis queue.
* ``answer.py``: what the client has of a running answer, so another worker can go on.
* ``failure.py``: what becomes of a job whose run failed (``after_failure``), the one rule
  for a router's workers and a pull-mode worker.
"""
