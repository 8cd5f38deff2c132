"""One text model of a worker serving several: its own llama-server, slots, pinning and
backend, and what the residency decision needs of it (its footprint, when a job last used
it, whether a job holds or waits for it).

Each model is a whole llama-server of its own, so ``/slots``, slot pinning, prefix summaries,
token ids and exact resume work per model as for a worker of one model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from shoal.models.residency import Footprint, Resident
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, ModelInfo
from shoal.worker.text.backend import Backend, BackendTarget
from shoal.worker.text.llama_server import LlamaServer, LlamaServerConfig
from shoal.worker.text.pinning import SlotPinning
from shoal.worker.text.residency.measured import footprint_from_log
from shoal.worker.text.residency.planned import PlannedModel
from shoal.worker.text.slots import SlotTable

HOLDS = frozenset({BackendState.READY, BackendState.LOADING, BackendState.RESTARTING})
"""The states in which a model's llama-server holds (or is taking) its memory."""


class HostedModel:
    """One text model's llama-server and what it serves through (built UNLOADED unless
    ``preload``; the manager, ``models.py``, loads and evicts it)."""

    def __init__(
        self,
        planned: PlannedModel,
        session: aiohttp.ClientSession,
        *,
        on_state: Callable[[HostedModel, BackendState, str], None],
        on_cache: Callable[[], None],
    ) -> None:
        plan = planned.plan
        assert plan.llama is not None  # several models: each a llama-server of ours
        self.plan = plan
        self.idle_unload_s = plan.llama.idle_unload_s
        """Seconds without jobs before it unloads (0: never); ``TextModels`` does it, saving
        its slots first, so its llama-server is told none."""
        self.config: LlamaServerConfig = replace(plan.llama, idle_unload_s=0.0)
        self.name: ModelName = plan.model.name
        self.pinned = planned.pinned
        self.preload = planned.preload
        self.server = LlamaServer(
            self.config, lambda state, detail: on_state(self, state, detail), start_unloaded=True
        )
        self.slots = SlotTable(self.config.slots, lambda _blocks: on_cache())
        """What this model's llama-server's slots hold."""
        self.pinning = SlotPinning(self.slots, session, lambda: self.server.url)
        target = BackendTarget(
            self.name, stream_upstream=True, token_ids=True, spare_path="/health"
        )
        self.backend = Backend(target, session, lambda: self.server.url, self.pinning)
        self.estimate = planned.estimate
        """The fit estimate, until a load measures it."""
        self.measured: Footprint | None = None
        """What llama-server reported on its last load (weights + KV + compute)."""
        self.holders = 0
        """Jobs holding this model or waiting for it."""
        self.last_used = time.monotonic()
        self.evictions = 0
        self.unloading = False
        """Being unloaded now (its slots saving, its process stopping): jobs wait it out."""
        self.load: asyncio.Future[None] | None = None
        """The load in progress (jobs for this model share it), None when none is."""

    @property
    def url(self) -> str:
        """Where its llama-server serves now (a kv-save hook reads its slots there)."""
        return self.server.url

    @property
    def state(self) -> BackendState:
        return self.server.state

    @property
    def footprint(self) -> Footprint:
        """What it holds when loaded: measured on its last load, else the estimate."""
        return self.measured or self.estimate

    @property
    def resident(self) -> bool:
        """It holds memory now, or is about to (a load decided)."""
        return self.state in HOLDS or self.load is not None

    def idle_until(self) -> float | None:
        """When it unloads for want of jobs (monotonic), if it is loaded and unheld and has
        an idle time; None otherwise."""
        if not self.idle_unload_s or self.holders or self.load is not None:
            return None
        if self.state is not BackendState.READY:
            return None
        return self.last_used + self.idle_unload_s

    def as_resident(self) -> Resident:
        busy = self.holders > 0 or self.load is not None or self.state is not BackendState.READY
        return Resident(self.name, self.footprint, self.last_used, self.pinned, busy)

    def loaded(self) -> None:
        """Its llama-server became ready: keep what it reported as the footprint."""
        measured = footprint_from_log(self.server.load_log)
        if measured is not None:
            self.measured = measured
        if self.server.loads == 1:
            # its prompt speed, once: measuring takes a slot, and on a reload every slot may
            # hold a conversation's cache just restored (``kv_saves.py``)
            self.pinning.ready()

    def info(self) -> ModelInfo:
        return self.plan.model.model_copy(
            update={
                "state": self.state,
                "slots": self.config.slots,
                "resident_bytes": self.footprint.total,
                "load_seconds": self.server.load_seconds,
                "pinned": self.pinned,
                "loads": self.server.loads,
                "evictions": self.evictions,
            }
        )
