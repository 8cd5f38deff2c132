"""Which router runs which deployment, when several routers share one Redis and database.

Shards are started through the WebSockets of the workers that hold them, so one router runs
each deployment: the holder of its lease (``leases``). Every ``SYNC_S`` each router
reloads the stored deployments (another router may have added, changed or removed one), takes
a free lease for a deployment that fits on its own workers, renews the leases it holds and
publishes its view of them, gives a lease back while its deployment waits for workers, and
stops a deployment whose lease went to another router or could not be renewed for a TTL.
Deployments run elsewhere are shown, and their requests let through to the shared queue, from
the holder's published view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from shoal.keys.errors import DatabaseError
from shoal.redis_queue.support import REDIS_DOWN, OutageLog, raise_if_cancelled
from shoal.router.deployments.deployment import Deployment, DeploymentSpec, DeploymentState
from shoal.router.deployments.leases import DeploymentLeases, Held

log = logging.getLogger(__name__)

SYNC_S = 2.0
"""How often deployments are reloaded and leases renewed."""


class Here(Protocol):
    """The deployments controller of this router, as the sharing drives it."""

    items: dict[str, Deployment]

    async def stored(self) -> list[DeploymentSpec] | None: ...

    def apply(self, specs: list[DeploymentSpec]) -> None:
        """Take in the stored deployments (added, changed or removed elsewhere)."""
        ...

    async def fits_here(self, d: Deployment) -> bool: ...

    def lose(self, name: str, why: str) -> None:
        """Stop running ``name`` here."""
        ...

    def view(self, d: Deployment) -> dict[str, Any]: ...

    def wake(self) -> None: ...


class Sharing:
    def __init__(self, leases: DeploymentLeases) -> None:
        self.leases = leases
        self.mine: set[str] = set()
        """The deployments this router holds the lease of, and runs."""
        self.elsewhere: dict[str, Held] = {}
        """The others' holders and views, as of the last sync."""
        self._sync_now = asyncio.Event()
        self._outage = OutageLog()
        self._database_down = False
        self._renewed_at = time.monotonic()

    def sync_soon(self) -> None:
        self._sync_now.set()

    async def run(self, here: Here) -> None:
        while True:
            try:
                await self._sync(here)
                self._outage.succeeded()
                self._renewed_at = time.monotonic()
            except REDIS_DOWN as exc:
                raise_if_cancelled()
                self._outage.failed("deployment leases", exc)
                if time.monotonic() - self._renewed_at > self.leases.ttl_ms / 1000:
                    for name in list(self.mine):  # another router may hold them by now
                        self.mine.discard(name)
                        here.lose(name, "its lease could not be renewed")
            self._sync_now.clear()
            try:
                async with asyncio.timeout(SYNC_S):
                    await self._sync_now.wait()
            except TimeoutError:
                pass

    async def _sync(self, here: Here) -> None:
        specs = await self._stored(here)
        if specs is not None:
            here.apply(specs)
            self.mine &= set(here.items)
        leases = self.leases
        for name, d in list(here.items.items()):
            if name in self.mine:
                if d.state is DeploymentState.PENDING and not await here.fits_here(d):
                    self.mine.discard(name)  # waiting for workers: let a router that has them
                    await leases.release(name)
                    continue
                owner = await leases.hold(name)
                if owner != leases.router:
                    self.mine.discard(name)
                    here.lose(name, f"router {owner} runs it now")
                elif name in here.items:
                    await leases.publish(name, here.view(d))
            elif (
                name not in self.elsewhere
                and await here.fits_here(d)
                and await leases.hold(name) == leases.router
            ):
                self.mine.add(name)
                d.retry_at = 0.0
                log.info("deployment %s: this router runs it (its workers fit it)", name)
                here.wake()
        self.elsewhere = await leases.held([n for n in here.items if n not in self.mine])

    async def _stored(self, here: Here) -> list[DeploymentSpec] | None:
        """The stored deployments; None while the database fails (leases are still renewed:
        the deployments running here go on)."""
        try:
            specs = await here.stored()
        except DatabaseError as exc:
            if not self._database_down:
                log.warning("deployments: %s; reading them again every %g s", exc, SYNC_S)
            self._database_down = True
            return None
        if self._database_down:
            log.info("deployments: the database answers again")
        self._database_down = False
        return specs

    async def let_go(self, name: str) -> None:
        """``name`` was undeployed here."""
        self.mine.discard(name)
        self.elsewhere.pop(name, None)
        try:
            await self.leases.release(name)
        except REDIS_DOWN as exc:  # its lease runs out by itself
            raise_if_cancelled()
            self._outage.failed("deployment leases", exc)

    def unavailable(self, model: str) -> str | None:
        """Why requests for ``model``, run by another router or by none, cannot be served."""
        held = self.elsewhere.get(model)
        view = held.view if held is not None else None
        if view is not None and view.get("state") == DeploymentState.SERVING.value:
            return None  # queued in Redis, where the router holding its head takes it
        where = f"router {held.router}" if held else "no router with the workers for it yet"
        state = view.get("state", "starting") if view else "pending"
        return (
            f"The model {model!r} is split over several workers and is {state} "
            f"({where}); retry in a few seconds."
        )

    def view(self, d: Deployment, here: Here) -> dict[str, Any]:
        """``d`` in the deployments' status: this router's view if it runs it, else the holder's."""
        if d.name in self.mine:
            return here.view(d) | {"router": self.leases.router}
        held = self.elsewhere.get(d.name)
        if held is not None and held.view is not None:
            return held.view | {"router": held.router}
        view = here.view(d) | {"router": held.router if held else None}
        view["detail"] = (
            f"starting on router {held.router}"
            if held
            else "waiting for a router whose workers can hold it"
        )
        return view
