"""The ``CacheKeeper`` of a worker serving several text models: its slots' KV caches saved
before a model is evicted, and put back once it has loaded again (``kv_saves.SlotSaves``), so
a conversation that returns to an evicted model reuses its prefix.

A cache that cannot be saved or restored costs that conversation a recompute, nothing more:
nothing here keeps an eviction or a load from going on.
"""

from __future__ import annotations

import logging

import aiohttp

from shoal.worker.text.residency.hosted import HostedModel
from shoal.worker.text.residency.kv_saves import SlotSaves

log = logging.getLogger(__name__)


class KeptCaches:
    """Saves a model's slots before it is evicted and restores them after it loads."""

    def __init__(self, saves: SlotSaves, session: aiohttp.ClientSession) -> None:
        self.saves = saves
        self.session = session

    async def before_unload(self, host: HostedModel) -> None:
        try:
            saved = await self.saves.save(self.session, host.url, host.config, host.slots)
        except Exception:  # a bug here must not keep the eviction (and the load) from going on
            log.exception("model %s: saving its slots' caches failed", host.name)
            return
        if saved:
            log.info("model %s: saved %d slot cache(s) before unloading", host.name, len(saved))

    async def after_load(self, host: HostedModel) -> None:
        try:
            restored = await self.saves.restore(self.session, host.url, host.config, host.slots)
        except Exception:  # a bug here must not fail the load: the slots start empty
            log.exception("model %s: restoring its slots' caches failed", host.name)
            return
        if restored:
            log.info("model %s: restored %d slot cache(s)", host.name, len(restored))
