"""The job path: a request's job from acceptance to its last byte, over one interface.

    request ──submit──▶ Dispatcher ──▶ where jobs wait ──▶ Running (this router's workers)
       ▲                   │ memory: FairQueue here          │ place: scheduler.pick_worker
       │                   │ redis:  Redis Streams, shared   │ frames: WorkerSide ▶ Running
       └── Job.events ◀── JobOutput ◀──── Sink ◀─────────────┘ memory: straight to the Job
                                                               redis: output stream ▶ tail

* ``interface.py``: ``Dispatcher``, what routes and the composition root may ask.
* ``memory.py`` / ``redis.py``: the two siblings; each holds only what differs: where
  jobs wait and how their output travels back.
* ``job.py``: a job's state machine. Its outcome events are ``shoal.jobs.events``, the one
  vocabulary for them here and on the Redis queue.
* ``running.py``: jobs running on this router's workers; the requeue rules.
* ``worker_side.py``: the workers' frames, routed the same way for both.
* ``output.py``: outcome events reaching the waiting request; first-token and inter-token
  timings.
* ``answers.py``: the 404/400/503/429 answers and the ``--max-wait`` rule.
* ``scheduler.py``: which worker takes a job (pure); ``need.py``: the context a job needs in
  a worker's slot, from its body (pure).
* ``holder.py``, ``directory.py``: with Redis, the claims for this router's workers and the
  list of every router's workers.
* ``workers.py``: the workers connected here (``WorkerConnection``, a state machine) and the
  ``Registry`` of them; ``outbox.py``: the frames waiting for each one's writer;
  ``model_views.py``: what they add up to per model, kept as they
  change; ``worker_names.py``: a worker named in the API → its id (pure); ``stall.py``: when
  a silent worker is taken for frozen (pure); ``heartbeats.py``: how often idle workers
  heartbeat for the fleet's size (pure, ``--heartbeat-rate``).
"""
