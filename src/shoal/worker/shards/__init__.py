"""This worker's parts in models split by layers across workers (``router/deployments/``
plans them).

* ``host.py``: ``ShardHost``, the shards the router starts here: a stage
  (``ggml-rpc-server``) or a head (``llama-server --rpc``), each a supervised process with
  its state machine; a head's jobs go to its llama-server (``JobRunner.route``).
* ``tools.py``: what shards need from this worker, decided at start (``ShardTools``: its
  llama.cpp build, devices, where a shard's model comes from), or why it takes no part.
* ``rpc_seed.py``: pre-seeding a stage's layers into ``ggml-rpc-server``'s cache.
* ``tunnels.py``: the worker's ends of the router's RPC tunnels.
"""
