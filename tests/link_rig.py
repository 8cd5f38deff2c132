"""A worker's router link built as the worker builds it, for tests that drive one directly.

Its registration describes a small machine with no models; it runs no parts of split models
(a shard asked of it fails with ``no_shards``) and loads no model on request.
"""

from __future__ import annotations

from pathlib import Path

from shoal.protocol.ids import WorkerId
from shoal.protocol.messages import PROTOCOL_VERSION, BackendState, Hardware, Register
from shoal.worker.backoff import Backoff
from shoal.worker.hardware import MemoryProbe, detect_profile
from shoal.worker.jobs.runner import JobRunner
from shoal.worker.link.outbox import Outbox
from shoal.worker.link.router_link import NoShards, RouterLink, Routers
from shoal.worker.shards.tools import NO_LLAMA_CPP
from shoal.worker.tls import client_tls_context


def registration(worker_id: str = "link-test") -> Register:
    return Register(
        protocol_version=PROTOCOL_VERSION,
        worker_id=WorkerId(worker_id),
        name=worker_id,
        hardware=Hardware(
            hostname="h", os="linux", cpu_count=1, ram_total_bytes=1, ram_available_bytes=1
        ),
        models=(),
        slots=1,
        state=BackendState.LOADING,
    )


def router_link(
    url: str,
    *,
    ca: Path | None = None,
    no_shards: str = NO_LLAMA_CPP,
    backoff: Backoff | None = None,
    outbox: Outbox | None = None,
) -> RouterLink:
    """A link to ``url``; ``ca`` verifies a wss:// router (None: the system's CAs)."""
    outbox = outbox or Outbox()
    return RouterLink(
        Routers([url], None, client_tls_context(ca)),
        registration,
        JobRunner(outbox),
        outbox,
        memory=MemoryProbe(detect_profile()),
        shards=NoShards(no_shards, outbox.send),
        model_control=lambda _msg: False,
        backoff=backoff,
    )
