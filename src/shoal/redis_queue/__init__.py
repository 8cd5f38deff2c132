"""The Redis job queue (``--redis-url``): what every router and pull-mode worker shares through
Redis. The in-process queue is ``router/dispatch/memory.py``; both speak ``shoal.jobs``.

* ``keys.py``: every Redis key Shoal uses (the queue's, and the rate limits', result cache's,
  async jobs', directory's and deployments'), built from one prefix.
* ``scripts.py`` (waiting: enqueue, positions, cancel), ``claim.py`` (``TAKE``, with prefix
  holds), ``leases.py`` (publish, renew, ack, give back, go on, adopt, reclaim): the Lua.
* ``calls.py``: the scripts by name, every call riding out an outage.
* ``streams.py``: ``RedisJobQueue``, the queue as its users see it (enqueue, claim, events).
* ``claimed.py``: a claimed job under its lease; ``consumer.py``: the loops every consumer
  runs beside its claims; ``recovery.py``: taking over the jobs of holders that stopped.
* ``tail.py``: reading many jobs' output with one blocking ``XREAD``.
* ``support.py``: the data types, errors and outage retry the others are built from.
"""
