"""Split models: a model too big for one worker, split by layers across several.

The words, used the same way in code, API, docs and dashboard:

* **deployment**: a model split across workers, as the user deployed it (``DeploymentSpec``,
  persisted) and as it stands (``Deployment``, a state machine);
* **shard**: one worker's part of a deployment (a contiguous range of layers);
* **head**: the shard that runs ``llama-server --rpc`` and serves the requests (the first);
* **stage**: a shard that runs ``ggml-rpc-server`` and holds layers for the head;
* **plan**: the planner's output, which layers go where (``placement.Plan``); the planner
  sees workers as **nodes** (an id, its RAM and its GPUs: the **devices** it offers, each
  holding a range of the shard's layers) and calls the last shard of a plan the **tail** (it
  holds the output layer; it runs as a stage).

"A split model" is plain English for a deployment's model. The public routes keep the
paths they were first published under, ``/api/v1/pipeline/...``.

Pure (data in, decision out; no I/O, no router state): ``placement`` (the layer planner;
its search in ``placement_search``), ``profile`` (a GGUF → the planner's profile),
``launch`` (a plan → the head's ``--device``/``--tensor-split``/``-ngl`` and each stage's
``-d``, and placed layers read back), ``deployment`` (what was asked, and the state machine),
``rebalance`` (whether a new plan is worth moving a serving deployment).
The rest runs in the router, which owns the workers' connections: ``controller`` (the loop
that deploys and heals), ``moves`` (when a serving deployment moves to a better plan: the
joins, the judgement, the answers to finish first), ``shards`` (what starts and stops a
deployment's shards on the workers, in order), ``sources`` (where a deployment's model is: the
router's copy, its own store or a ``--model-store``, read by the header alone), ``nodes``
(which workers a plan is made over), ``store`` (the deployments in the router's database),
``leases`` + ``sharing`` (which router runs each deployment when several share Redis),
``tunnels`` (the RPC tunnel hub, told about workers) and ``views`` (the status JSON). The HTTP
API is ``router/routes/deployments.py``.
"""
