"""How jobs reach the worker and its answers leave: one link at a time, a router or Redis.

* ``router_link.py``: ``RouterLink``, the WebSocket to a router (dial, register, heartbeat,
  reconnect; a state machine), and the router's orders it passes on (jobs, model controls,
  split-model orders: ``ShardOrders``).
* ``heartbeats.py``: ``Heartbeats``, the heartbeats to the router at the pace it sets
  (``HeartbeatInterval`` while idle, the base interval while a job runs).
* ``dialing.py``: what the worker says when it cannot join a router (pure).
* ``outbox.py``: frames waiting for the router, batched, and each job's journal (its output
  kept until a router takes it back after a lost connection).
* ``redis_pull.py``: pull mode (``--redis-url``): ``RedisPuller`` claims jobs straight from
  the Redis job queue; ``redis_presence.py``: its entry in the cluster's worker list.
* ``drain.py``: SIGTERM: take no new job, answer every running one, then stop.
"""
