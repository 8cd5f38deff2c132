"""A deployment (a model split across workers): what was asked, and where it stands.

``DeploymentSpec`` is what the operator asked for (``POST /api/v1/pipeline/deploy``) and is
persisted; ``Deployment`` adds the live state, which the controller rebuilds after a router
restart. The lifecycle::

    PENDING ──a plan fits──▶ STARTING ──stages ready, then the head──▶ SERVING
       ▲                        │                                        │  │
       └──────── redeploy ◀── DEGRADED ◀──── a shard failed or its worker left
       ▲                                                                    │
       └── answers in flight done: switch ◀── DRAINING ◀── a better plan ──┘
    any ──undeploy──▶ (gone)

``ALLOWED`` is that diagram as a table (``shoal.lifecycle``); any other move raises
``IllegalTransition``. PENDING waits for workers (with the reason, e.g. the memory
shortfall); DEGRADED answers requests with 503 + ``Retry-After`` until the redeploy is SERVING
again. DRAINING (a rebalance: ``rebalance``) takes no new request (503 + ``Retry-After``) and
lets the head finish the answers it runs; then its shards stop and it is planned again.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Literal

from shoal.lifecycle import Transitions
from shoal.protocol.messages import (
    DevicePlacement,
    LinkRtt,
    ModelFile,
    SeedReport,
    ShardRole,
    ShardState,
    StoreFile,
)
from shoal.router.deployments.placement import Plan, Strategy

log = logging.getLogger(__name__)

Mode = Literal["relayed", "direct"]
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class DeploymentState(enum.StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    SERVING = "serving"
    DEGRADED = "degraded"
    DRAINING = "draining"


ALLOWED = Transitions(
    {
        DeploymentState.PENDING: {DeploymentState.STARTING, DeploymentState.PENDING},
        DeploymentState.STARTING: {
            DeploymentState.SERVING,
            DeploymentState.DEGRADED,
            DeploymentState.PENDING,
        },
        DeploymentState.SERVING: {
            DeploymentState.DEGRADED,
            DeploymentState.PENDING,
            DeploymentState.DRAINING,
        },
        DeploymentState.DRAINING: {
            DeploymentState.PENDING,
            DeploymentState.DEGRADED,
            DeploymentState.DRAINING,
        },
        DeploymentState.DEGRADED: {
            DeploymentState.STARTING,
            DeploymentState.PENDING,
            DeploymentState.DEGRADED,
        },
    }
)
"""A move to the same state is a new reason to be in it (the reason is logged, if new)."""


@dataclass(frozen=True, slots=True)
class TunnelBytes:
    """Bytes a deployment's RPC tunnels carried through the router (relayed mode)."""

    to_stages: int = 0
    """Head -> stages: weights sent at load, and activations per token."""
    to_head: int = 0

    def __add__(self, other: TunnelBytes) -> TunnelBytes:
        return TunnelBytes(self.to_stages + other.to_stages, self.to_head + other.to_head)

    def __sub__(self, other: TunnelBytes) -> TunnelBytes:
        return TunnelBytes(self.to_stages - other.to_stages, self.to_head - other.to_head)


@dataclass(frozen=True, slots=True)
class StageLink:
    """One stage's tunnel as the router's hub sees it (relayed mode): the bytes it carried
    and how long the stage took to answer the head's requests."""

    carried: TunnelBytes
    turnarounds_ns: tuple[int, ...]
    """The last request->reply turnarounds (``tunnel.relay.Traffic``), oldest first."""
    connections: int
    """The head's connections to the stage open now."""


@dataclass(frozen=True, slots=True)
class DeployCost:
    """What the last deploy (from STARTING to SERVING) took."""

    seconds: float
    tunnel: TunnelBytes


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """What was asked: persisted, and the same on every router."""

    name: str
    """The public model name the split model is served under."""
    source: str
    """The model: a catalog id, a model-store id or a .gguf path (the head loads it)."""
    ctx: int
    strategy: Strategy
    workers: tuple[str, ...] | None
    """Worker names or ids in shard order (the first is the head); None: any."""
    mode: Mode
    slots: int = 1
    created_at: float = field(default_factory=time.time)


@dataclass(eq=False, slots=True)
class ShardView:
    """One shard as the controller sees it."""

    worker_id: str
    role: ShardRole
    first_layer: int
    last_layer: int
    planned_bytes: int
    free_bytes: int
    state: ShardState = ShardState.STARTING
    detail: str = ""
    build: str = ""
    rpc_address: str | None = None
    devices: tuple[int, ...] = ()
    """A ready stage: free bytes of each device it serves (``ShardStatus.devices``)."""
    placement: tuple[DevicePlacement, ...] = ()
    seed: SeedReport | None = None
    """A stage: what it pre-seeded into its RPC cache before it started."""
    head_rtt: LinkRtt | None = None
    """A stage: its RPC round trips as the head timed them (``ShardLinks``, relayed mode)."""


@dataclass(eq=False, slots=True)
class Deployment:
    spec: DeploymentSpec
    state: DeploymentState = DeploymentState.PENDING
    detail: str = "waiting for workers"
    plan: Plan | None = None
    file: ModelFile | None = None
    """The exact file the current attempt's shards use (``pin``; None: a path or store id)."""
    store: StoreFile | None = None
    """The model store and version the current attempt's shards fetch (None: not a store's)."""
    shards: list[ShardView] = field(default_factory=list)
    attempts: int = 0
    """Deploy attempts since it last served (for the retry backoff)."""
    retry_at: float = 0.0
    changed_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0
    """When the current attempt started (monotonic)."""
    tunnel_at_start: TunnelBytes = field(default_factory=TunnelBytes)
    last_deploy: DeployCost | None = None
    rebalance_at: float = 0.0
    """When a worker that joined is judged for a rebalance (the end of the quiet period after
    the last join; monotonic; 0: none due)."""
    drain_until: float = 0.0
    """DRAINING: when it switches even with answers still running (monotonic)."""
    give_back: Plan | None = None
    """The plan a rebalance left: the next plan counts the memory it held as free again (its
    workers may still report it used for a moment)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def head(self) -> ShardView | None:
        return self.shards[0] if self.shards else None

    @property
    def stages(self) -> list[ShardView]:
        return self.shards[1:]

    def move(self, new: DeploymentState, detail: str) -> None:
        who = f"deployment {self.name}"
        if new is self.state and detail == self.detail:
            ALLOWED.check(who, self.state, new)  # no news: checked, not logged
        else:
            ALLOWED.move(who, self.state, new, f"({detail})", log)
        self.state, self.detail, self.changed_at = new, detail, time.monotonic()
        if new is DeploymentState.SERVING:
            self.attempts = 0

    def shard_of(self, worker_id: str) -> ShardView | None:
        return next((s for s in self.shards if s.worker_id == worker_id), None)
