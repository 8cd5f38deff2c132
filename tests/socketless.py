"""Worker connections without sockets, for router tests: a worker as it registers, already
``ACTIVE``; what the router sends it is read from ``worker.outbox``."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.protocol.ids import WorkerId
from shoal.protocol.messages import (
    PROTOCOL_VERSION,
    BackendState,
    Hardware,
    ModelInfo,
    Register,
)
from shoal.router.dispatch.memory import MemoryDispatcher
from shoal.router.dispatch.workers import ConnState, Registry, WorkerConnection
from shoal.router.observe.metrics import Metrics, Snapshot
from shoal.router.settings import RouterSettings


def worker_connection(
    name: str,
    models: Sequence[ModelInfo] = (),
    *,
    slots: int = 1,
    ram_bytes: int = 1,
    worker_id: str | None = None,
    model_budget_bytes: int | None = None,
) -> WorkerConnection:
    """A registered worker named ``name`` (its id too, unless given) serving ``models``
    (``model_budget_bytes``: a worker serving several text models, each loading apart)."""
    hardware = Hardware(
        hostname=name,
        os="linux",
        cpu_count=2,
        ram_total_bytes=ram_bytes,
        ram_available_bytes=ram_bytes,
    )
    worker = WorkerConnection.from_register(
        Register(
            protocol_version=PROTOCOL_VERSION,
            worker_id=WorkerId(worker_id or name),
            name=name,
            hardware=hardware,
            models=tuple(models),
            slots=slots,
            state=BackendState.READY,
            model_budget_bytes=model_budget_bytes,
        ),
        peer="test",
    )
    worker.move(ConnState.ACTIVE, "test")
    return worker


def memory_dispatcher(settings: RouterSettings | None = None) -> MemoryDispatcher:
    """The in-process dispatcher over an empty registry, with metrics nobody scrapes."""
    return MemoryDispatcher(settings or RouterSettings(), Registry(), Metrics(Snapshot))
