"""The deployments controller, in the router: deploys split models and keeps them serving.

Each deployment (``deployment.Deployment``) is driven by the events that concern it, never
by polling: an API call, a worker joining or leaving, a ``ShardStatus`` from a worker, or the
retry time of a deployment that failed. ``run()`` waits for the next of them and then
reconciles every deployment:

* PENDING / DEGRADED (once its retry time has come): find the model (``sources``: the
  router's copy, or a model store's header, read afresh so a changed file is planned anew)
  and plan over the connected workers from its GGUF structure (``profile``); if it fits, pin
  the file planned with (``pin``, or the store and sha256 it was found with: head and stages
  then use that one file, not each its own choice of quantization), start a stage
  (``ggml-rpc-server``) on every shard but the first, and go STARTING; otherwise stay
  PENDING with the shortfall.
* STARTING: when every stage is ready and runs the head's llama.cpp build, open a tunnel per
  stage through the router (relayed mode; direct mode uses the stages' addresses) and start
  the head with the plan's ``-ngl``/``--tensor-split``. The head reports where the layers
  went; SERVING when it serves the model, which then appears in ``/v1/models`` because the
  head worker advertises it.
* A worker that joins while a deployment serves (one it may be planned over): after
  ``rebalance_quiet_s`` without another join, the deployment is planned again over the
  workers there are, with the memory it holds given back (``rebalance.reclaimed``), and
  ``rebalance.better`` judges the new plan against the serving one (``moves``). A better
  plan: DRAINING (no new request; the head finishes the answers it runs, at most
  ``DRAIN_TIMEOUT_S``), then every shard stops and it is planned and started again
  (PENDING). Not better: nothing happens (logged at DEBUG). ``POST …/rebalance`` drains
  and switches the same way whenever the plan would change.
* A shard that fails, or a worker of the deployment that leaves: DEGRADED. Every shard is
  stopped and a redeploy is tried after a backoff (and at once when a worker joins).
  Requests for the model meanwhile get a 503 with ``Retry-After``.

Deployments are kept in the router's database (``store``) and deployed again
after a restart as workers connect.

This module decides *when*: the state machine's transitions, retries and backoff, the events.
*How* a deployment's shards start and stop (the ``ShardStart`` each worker gets, the head's
peers and tunnels, ``ShardStop``) is ``shards``.

Several routers on one Redis and one database: each runs only the deployments whose lease
it holds (``sharing``), and shows the others as their holders published them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from shoal.models.errors import ModelError
from shoal.models.gguf_info import GGUFInfo
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import (
    ModelFile,
    ShardLinks,
    ShardRole,
    ShardState,
    ShardStatus,
    ShardStop,
)
from shoal.router.deployments.deployment import (
    DeployCost,
    Deployment,
    DeploymentSpec,
    DeploymentState,
)
from shoal.router.deployments.launch import too_many_devices
from shoal.router.deployments.leases import DeploymentLeases
from shoal.router.deployments.moves import Moves
from shoal.router.deployments.nodes import deployment_nodes
from shoal.router.deployments.placement import Node, NoFit, Plan
from shoal.router.deployments.profile import Planned, plan_for
from shoal.router.deployments.rebalance import layout, reclaimed
from shoal.router.deployments.shards import (
    Shards,
    Tunnels,
    other_builds,
    placement_note,
    shard_views,
)
from shoal.router.deployments.sharing import Sharing
from shoal.router.deployments.sources import Located
from shoal.router.deployments.views import deployment_view
from shoal.router.dispatch.workers import Registry, WorkerConnection

log = logging.getLogger(__name__)

RETRY_FIRST_S = 2.0
RETRY_MAX_S = 30.0
START_TIMEOUT_S = 300.0
"""A deployment whose shards are not all ready this long after starting is redeployed."""
MAX_DEPLOYMENTS = 32
REBALANCE_QUIET_S = 5.0
"""The default quiet period after a worker joins before a rebalance is judged (several
workers joining at once give one rebalance)."""
DRAIN_TIMEOUT_S = 300.0
"""A rebalance switches after this long even if answers are still running (those end with
the head: their clients get the error a lost worker gives)."""
DRAIN_CHECK_S = 0.25
"""How often a draining deployment looks whether its head's answers have ended."""
LOCATE_RETRY_S = 10.0
"""A deployment whose model could not be found (a store down, a file gone) looks again after
this long, or at the next event."""


class Specs(Protocol):
    """Where the deployments are kept (``store.DeploymentStore``: the router's database)."""

    def load(self) -> list[DeploymentSpec]: ...

    def save(self, spec: DeploymentSpec) -> None: ...

    def delete(self, name: str) -> bool: ...


class Sources(Protocol):
    """Where a deployment's model is and its structure (``sources.ModelSources``)."""

    async def locate(self, source: str) -> Located: ...


class DeploymentError(Exception):
    """A deploy request that cannot be accepted (unknown model, bad worker list)."""


class Deployments:
    def __init__(
        self,
        registry: Registry,
        store: Specs,
        tunnels: Tunnels,
        sources: Sources,
        leases: DeploymentLeases | None = None,
        *,
        pin: Callable[[str], ModelFile | None],
        rebalance_quiet_s: float = REBALANCE_QUIET_S,
    ) -> None:
        """``sources``: a model source -> its structure and where it is (raises
        ``ModelError``), for planning. ``pin``: a catalog id or path -> the exact file every
        shard must use (``pin.pin_model``; None: a path, used as it is; blocking). ``leases``:
        shared with other routers (None: this router runs every deployment).
        ``rebalance_quiet_s``: how long after the last worker joined a serving deployment is
        judged for a rebalance."""
        self.registry = registry
        self.store = store
        self.tunnels = tunnels
        self.sources = sources
        self.pin = pin
        self.located: dict[str, Located] = {}  # by deployment name, as last found
        self.shards = Shards(registry, tunnels)
        self.sharing = Sharing(leases) if leases is not None else None
        self.items: dict[str, Deployment] = {}
        self._edits = 0  # writes of the stored deployments by this router's API, done
        self._in_edit = 0  # and under way
        self._kv_per_layer: dict[str, int] = {}  # for reading layer counts from placements
        self._n_layers: dict[str, int] = {}
        self._wake = asyncio.Event()
        self.moves = Moves(registry, self._info, rebalance_quiet_s)
        registry.listen(self._on_worker_changed)

    # ------------------------------------------------------------ API side

    async def load(self) -> None:
        """The deployments persisted by earlier runs (deployed as workers connect)."""
        for spec in await asyncio.to_thread(self.store.load):
            if spec.name in self.items:
                continue  # deployed through the API while this read ran: that one is live
            self.items[spec.name] = Deployment(spec)
            log.info("deployment %s of %s restored; waiting for workers", spec.name, spec.source)
        self.wake()

    async def deploy(self, spec: DeploymentSpec) -> Deployment:
        """Accept and persist a deployment; it starts as soon as a plan fits."""
        located = await self.sources.locate(spec.source)  # raises for an unknown model
        old = self.items.get(spec.name)
        if old is None and len(self.items) >= MAX_DEPLOYMENTS:
            raise DeploymentError(
                f"this router already runs {MAX_DEPLOYMENTS} deployments; undeploy one first"
            )
        if old is not None and old.spec.source != spec.source:
            raise DeploymentError(
                f"a deployment named {spec.name!r} of {old.spec.source} exists; undeploy it "
                "first or choose another name"
            )
        with self._editing():
            await asyncio.to_thread(self.store.save, spec)
        if old is not None:
            self.shards.stop(old, "redeployed with new settings")
        deployment = Deployment(spec)
        self.items[spec.name] = deployment
        self.located[spec.name] = located
        log.info(
            "deployment %s of %s (%s) accepted (%s mode)",
            spec.name,
            spec.source,
            located.where(),
            spec.mode,
        )
        if self._runs(deployment):
            self._reconcile(deployment, time.monotonic())
        self.wake()
        if self.sharing is not None:
            self.sharing.sync_soon()
        return deployment

    async def undeploy(self, name: str) -> Deployment | None:
        deployment = self.items.pop(name, None)
        if deployment is None:
            return None
        self.located.pop(name, None)
        with self._editing():
            await asyncio.to_thread(self.store.delete, name)
        self.shards.stop(deployment, "undeployed")
        if self.sharing is not None:
            await self.sharing.let_go(name)
        log.info("deployment %s undeployed", name)
        return deployment

    def rebalance(self, name: str | None) -> list[Deployment]:
        """Plan again over the workers there are now and redeploy where the plan changed: a
        serving deployment drains first (its answers in flight finish), then switches."""
        chosen = [d for d in self.items.values() if name is None or d.name == name]
        for d in chosen:
            if not self._runs(d) or d.state is DeploymentState.DRAINING:
                continue  # its router rebalances it; or it is switching already
            serving = d.plan if d.state is DeploymentState.SERVING else None
            planned = self._plan(d, serving)
            new = planned.result if planned is not None else None
            if not isinstance(new, Plan) or (d.plan is not None and layout(d.plan) == layout(new)):
                continue
            if serving is not None:
                self._drain(d, "rebalance requested")
            else:
                self.shards.stop(d, "rebalancing")
                d.move(DeploymentState.PENDING, "rebalancing")
                d.retry_at = 0.0
        self.wake()
        return chosen

    def unavailable(self, model: ModelName) -> str | None:
        """Why requests for a deployed model cannot be served now (None: they can)."""
        d = self.items.get(model)
        if d is None:
            return None
        if self.sharing is not None and not self._runs(d):
            return self.sharing.unavailable(model)
        if d.state is DeploymentState.SERVING:
            return None
        return (
            f"The model {model!r} is split over several workers and is {d.state.value} "
            f"({d.detail}); retry in a few seconds."
        )

    # ------------------------------------------------------------ worker side

    def on_registered(self, worker: WorkerConnection) -> None:
        """A worker joined: stop shards it may still run from before; plans may fit now, and
        serving ones may be better with it (judged after the quiet period, once it is ready)."""
        for d in self.items.values():
            if d.shard_of(worker.id) is None:
                worker.send(ShardStop(deployment=d.name))
            elif d.state is not DeploymentState.PENDING:
                self._degrade(d, f"worker {worker.id} reconnected")
        self.moves.registered(worker, self.items.values())
        self.wake()

    def _on_worker_changed(self, worker: WorkerConnection) -> None:
        """A worker's state changed (``Registry.listen``): one that became ready may fit a
        pending plan, or join a serving one."""
        if worker.ready:
            self.moves.became_ready(worker, self.items.values())
            self.wake()

    def on_lost(self, worker: WorkerConnection) -> None:
        self.moves.lost(worker)
        for d in self.items.values():
            if d.shard_of(worker.id) is not None and d.state is not DeploymentState.PENDING:
                self._degrade(d, f"worker {worker.id} ({worker.name}) left")
        self.wake()

    def on_shard(self, worker: WorkerConnection, msg: ShardStatus) -> None:
        d = self.items.get(msg.deployment)
        shard = d.shard_of(worker.id) if d is not None else None
        if d is None or shard is None or shard.role is not msg.role:
            if msg.state in (ShardState.STARTING, ShardState.READY):
                worker.send(ShardStop(deployment=msg.deployment))  # not part of it (any more)
            return
        shard.state, shard.detail, shard.build = msg.state, msg.detail, msg.build
        shard.rpc_address = msg.rpc_address
        shard.devices = msg.devices
        shard.placement = msg.placement
        shard.seed = msg.seed or shard.seed
        odd = other_builds(d, shard)
        if odd:
            self._degrade(d, odd)
        elif msg.state is ShardState.FAILED:
            self._degrade(d, f"{shard.role.value} on {worker.id} failed: {msg.detail}")
        elif msg.state is ShardState.READY and d.state is DeploymentState.STARTING:
            if shard.role is ShardRole.HEAD:
                d.last_deploy = DeployCost(
                    seconds=round(time.monotonic() - d.started_at, 3),
                    tunnel=self.tunnels.traffic(d.name) - d.tunnel_at_start,
                )
                d.move(DeploymentState.SERVING, placement_note(d))
            elif all(s.state is ShardState.READY for s in d.stages):
                self._start_head(d)
        self.wake()

    def on_links(self, worker: WorkerConnection, msg: ShardLinks) -> None:
        """A serving head's round trips to its stages: kept on each stage's view for status."""
        d = self.items.get(msg.deployment)
        head = d.shard_of(worker.id) if d is not None else None
        if d is None or head is None or head.role is not ShardRole.HEAD:
            return  # not (any more) the head of it: a late report
        for rtt in msg.stages:
            stage = d.shard_of(rtt.worker_id)
            if stage is not None and stage.role is ShardRole.STAGE:
                stage.head_rtt = rtt

    # ------------------------------------------------------------ the loop

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        await self.load()
        async with asyncio.TaskGroup() as tg:
            if self.sharing is not None:
                tg.create_task(self.sharing.run(self))
            await self._reconcile_loop()

    async def _reconcile_loop(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            mine = [d for d in self.items.values() if self._runs(d)]
            for d in mine:
                if _starts(d, now):
                    await self._locate(d)
                    if self.items.get(d.name) is not d:
                        continue  # undeployed or replaced while its model was looked up
                self._reconcile(d, now)
            waits = [t - now for d in mine for t in (d.retry_at, d.rebalance_at) if t > now]
            try:
                async with asyncio.timeout(min(waits) if waits else None):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _runs(self, d: Deployment) -> bool:
        return self.sharing is None or d.name in self.sharing.mine

    # ------------------------------------------------------------ several routers

    async def stored(self) -> list[DeploymentSpec] | None:
        """The stored deployments, or None when they cannot be trusted to match ``items``:
        an API call here changed them while they were read (the next sync reads again)."""
        edits = self._edits
        specs = await asyncio.to_thread(self.store.load)
        return specs if self._edits == edits and not self._in_edit else None

    @contextlib.contextmanager
    def _editing(self) -> Iterator[None]:
        """Around a write of the stored deployments by this router's API."""
        self._in_edit += 1
        try:
            yield
        finally:
            self._in_edit -= 1
            self._edits += 1

    def apply(self, specs: list[DeploymentSpec]) -> None:
        """The stored deployments, as another router may have changed them."""
        stored = {s.name: s for s in specs}
        for name in [n for n in self.items if n not in stored]:
            self.shards.stop(self.items.pop(name), "undeployed on another router")
            self.located.pop(name, None)
        for name, spec in stored.items():
            old = self.items.get(name)
            if old is None or _settings(old.spec) != _settings(spec):
                if old is not None:
                    self.shards.stop(old, "redeployed with new settings on another router")
                self.located.pop(name, None)  # found again before it is planned
                self.items[name] = Deployment(spec)
                self.wake()

    def lose(self, name: str, why: str) -> None:
        d = self.items.get(name)
        if d is not None and d.state is not DeploymentState.PENDING:
            self.shards.stop(d, why)
            d.move(DeploymentState.PENDING, why)

    async def fits_here(self, d: Deployment) -> bool:
        """Whether ``d`` could be planned over this router's workers now (no side effects)."""
        nodes = deployment_nodes(self.registry, d.spec.workers)
        if isinstance(nodes, str):
            return False
        try:
            info = (await self.sources.locate(d.spec.source)).info
        except ModelError:  # a model not found fits nowhere; _plan says why where it runs
            return False
        return isinstance(plan_for(info, nodes, d.spec.ctx, d.spec.strategy).result, Plan)

    # ------------------------------------------------------------ one deployment

    def _reconcile(self, d: Deployment, now: float) -> None:
        if d.state is DeploymentState.STARTING and now - d.changed_at > START_TIMEOUT_S:
            self._degrade(d, f"not ready after {START_TIMEOUT_S:g} s")
        if d.state is not DeploymentState.SERVING:
            d.rebalance_at = 0.0  # it is planned again anyway
        elif d.rebalance_at and now >= d.rebalance_at:
            d.rebalance_at = 0.0
            if (why := self.moves.judge(d)) is not None:
                self._drain(d, f"rebalancing: {why}")
        if d.state is DeploymentState.DRAINING and now >= d.retry_at:
            self._drain_step(d, now)
        if _starts(d, now):
            self._start(d)

    # ------------------------------------------------------------ rebalancing

    def _drain(self, d: Deployment, why: str) -> None:
        now = time.monotonic()
        d.move(DeploymentState.DRAINING, f"{why}; answers in flight finish first")
        d.drain_until = now + DRAIN_TIMEOUT_S
        d.retry_at = 0.0  # look at its answers at once

    def _drain_step(self, d: Deployment, now: float) -> None:
        """Switch once the head runs no answer of ``d`` (or the drain timed out)."""
        running = self.moves.in_flight(d)
        if running and now < d.drain_until:
            d.retry_at = now + DRAIN_CHECK_S
            return
        if running:
            log.warning(
                "deployment %s: %d answer(s) still running after %g s; switching anyway",
                d.name,
                running,
                DRAIN_TIMEOUT_S,
            )
        d.give_back = d.plan
        self.shards.stop(d, "rebalancing")
        d.move(DeploymentState.PENDING, "rebalancing: answers in flight done, switching")
        d.attempts = 0
        d.retry_at = 0.0

    # ------------------------------------------------------------ planning and starting

    async def _locate(self, d: Deployment) -> None:
        """Find ``d``'s model again before it is planned: the router's file may have changed,
        a store may hold another version (or be down: the deployment waits, saying why)."""
        try:
            located = await self.sources.locate(d.spec.source)
            if self.items.get(d.name) is d:
                self.located[d.name] = located
            return
        except ModelError as exc:  # the file went away or the store is down: keep the deployment
            why = str(exc)
        except Exception as exc:  # a damaged file: say so, keep the deployment
            why = repr(exc)
        if self.items.get(d.name) is not d:
            return
        self.located.pop(d.name, None)
        self._pending(d, f"cannot read {d.spec.source}: {why}")
        d.retry_at = time.monotonic() + LOCATE_RETRY_S  # a store back up is found unasked

    def _plan(self, d: Deployment, give_back: Plan | None = None) -> Planned | None:
        """A plan for ``d`` over the workers there are, counting the memory ``give_back``
        (a plan ``d`` serves or served) holds as free."""
        nodes = self._nodes(d)
        if nodes is None:
            return None
        if give_back is not None:
            nodes = reclaimed(nodes, give_back)
        located = self.located.get(d.name)
        if located is None:  # not looked up yet (``_locate`` says why when it fails)
            return None
        return plan_for(located.info, nodes, d.spec.ctx, d.spec.strategy)

    def _info(self, d: Deployment) -> GGUFInfo | None:
        """The structure of ``d``'s model as last found (None: not found yet)."""
        located = self.located.get(d.name)
        return located.info if located is not None else None

    def _nodes(self, d: Deployment) -> list[Node] | None:
        nodes = deployment_nodes(self.registry, d.spec.workers)
        if isinstance(nodes, str):
            self._pending(d, nodes)
            return None
        return nodes

    def _start(self, d: Deployment) -> None:
        planned = self._plan(d, d.give_back)
        d.give_back = None  # for the first attempt after a rebalance only
        if planned is None:
            return
        result = planned.result
        if isinstance(result, NoFit):
            self._pending(d, result.reason)
            return
        if (why := too_many_devices(result)) is not None:
            self._pending(d, why)
            return
        located = self.located[d.name]
        try:
            # the file planned with: every shard uses it (a store's: that store, that sha256)
            d.store = located.store
            d.file = self.pin(d.spec.source) if located.store is None else None
        except Exception as exc:  # the file went away or broke: say so, keep the deployment
            self._pending(d, f"cannot pin {d.spec.source}: {exc}")
            return
        d.plan = result
        d.shards = shard_views(result)
        d.attempts += 1
        d.started_at = time.monotonic()
        d.tunnel_at_start = self.tunnels.traffic(d.name)
        d.retry_at = d.started_at + _backoff(d.attempts)
        layers = ", ".join(f"{s.worker_id}: {s.first_layer}-{s.last_layer}" for s in d.shards)
        d.move(DeploymentState.STARTING, f"layers {layers}")
        self._kv_per_layer[d.name] = planned.kv_bytes_per_layer()
        self._n_layers[d.name] = planned.info.n_layers
        if not d.stages:
            self._start_head(d)
            return
        self.shards.start_stages(d)

    def _start_head(self, d: Deployment) -> None:
        why = self.shards.start_head(d)
        if why:
            self._degrade(d, why)

    def _pending(self, d: Deployment, why: str) -> None:
        if d.state is not DeploymentState.PENDING:
            self.shards.stop(d, why)
        d.move(DeploymentState.PENDING, why)
        d.retry_at = 0.0  # planned again at the next event (a worker joining, a heartbeat)

    def _degrade(self, d: Deployment, why: str) -> None:
        self.shards.stop(d, why)
        if d.state is not DeploymentState.PENDING:
            d.move(DeploymentState.DEGRADED, why)
        d.retry_at = time.monotonic() + _backoff(d.attempts)

    # ------------------------------------------------------------ views

    def view(self, d: Deployment) -> dict[str, Any]:
        return deployment_view(
            d,
            self.registry,
            self._kv_per_layer.get(d.name, 0),
            self._n_layers.get(d.name),
            self.tunnels.traffic(d.name),
            self.tunnels.links(d.name),
        )

    def status(self) -> list[dict[str, Any]]:
        if self.sharing is None:
            return [self.view(d) for d in self.items.values()]
        return [self.sharing.view(d, self) for d in self.items.values()]


def _settings(spec: DeploymentSpec) -> DeploymentSpec:
    """What a deployment asks for, without when (as read back from the database)."""
    return dataclasses.replace(spec, created_at=0.0)


def _starts(d: Deployment, now: float) -> bool:
    """Whether ``d`` is to be planned and started now."""
    waiting = d.state in (DeploymentState.PENDING, DeploymentState.DEGRADED)
    return waiting and now >= d.retry_at


def _backoff(attempts: int) -> float:
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** max(attempts - 1, 0)))
