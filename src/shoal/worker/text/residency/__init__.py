"""Several text models on one worker, kept by measured memory.

Each model is its own llama-server. The ones that fit stay loaded; a job for one that is not
loads it, first evicting the least recently used ones it does not fit beside
(``shoal.models.residency.admit``, a pure decision the router shares).

- ``models_file.py``: the models file (TOML or YAML) and its per-model options;
- ``budget.py``: the memory they may hold together, and a model's first-load estimate;
- ``measured.py``: what a model holds once loaded, as llama-server reported it;
- ``kv_saves.py``: a model's slots' KV caches saved before it is evicted and put back when
  it loads again (``SlotSaves``);
- ``keeper.py``: ``KeptCaches``, the ``CacheKeeper`` that runs those saves and restores;
- ``planned.py``: one ``Plan`` per model (``--models-file``, or ``--model`` given several
  times), whether each is pinned and preloaded, and how its llama-server runs as one of
  several (its buffers logged, no RAM prompt cache, its slots saved);
- ``hosted.py``: ``HostedModel``, one model's own llama-server, slots, pinning and backend,
  with its footprint (measured on its last load, else the estimate) and its stats;
- ``models.py``: ``TextModels``, which loads a model for its jobs (one load shared), evicts
  what ``admit`` names, and refuses a model that cannot fit; ``CacheKeeper``, the hook told
  before an eviction and after a load; ``worker_state`` (pure).
"""
