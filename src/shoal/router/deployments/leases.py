"""Which router runs each deployment, when several routers share one Redis and one database.

Deployments are stored in the shared database, so every router knows them all; but a
deployment's shards are started through the WebSockets of the workers that hold them, so one
router must run it: the one holding its **lease**, a Redis key naming the router
(``redis_queue.keys.deployment_lease_key``: ``shoal:deploy:NAME`` with the default prefix), with a
time to live that its holder renews. A router takes a free lease only for a deployment that
fits on its own workers, gives it back when it no longer fits there, and loses it when it
stops renewing (a dead router's deployments move on after ``ttl``). The holder also
publishes its view of the deployment (``status``, ``redis_queue.keys.deployment_view_key``), so
every router answers ``/api/v1/pipeline/status`` and knows whether requests for the model
can be served.

All scripts run on Redis's own clock and are atomic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shoal.redis_queue.keys import deployment_lease_key, deployment_view_key

# KEYS[1] lease; ARGV[1] router, ARGV[2] ttl ms. -> the holder after the call.
_HOLD = """
local owner = redis.call('GET', KEYS[1])
if owner == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return owner
"""

# KEYS[1] lease, KEYS[2] view; ARGV[1] router. Drops both if this router holds the lease.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
return 0
"""

# KEYS[1] lease, KEYS[2] view; ARGV[1] router, ARGV[2] ttl ms, ARGV[3] view JSON.
_PUBLISH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return 1
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Held:
    """A deployment run by some router, as that router last published it."""

    router: str
    view: dict[str, Any] | None


class DeploymentLeases:
    def __init__(
        self, redis: aioredis.Redis, prefix: str, router: str, *, ttl_s: float = 10.0
    ) -> None:
        self.router = router
        self.ttl_ms = int(ttl_s * 1000)
        self._redis = redis
        self._prefix = prefix
        self._hold = redis.register_script(_HOLD)
        self._release = redis.register_script(_RELEASE)
        self._publish = redis.register_script(_PUBLISH)

    def _keys(self, name: str) -> list[str]:
        return [
            deployment_lease_key(self._prefix, name),
            deployment_view_key(self._prefix, name),
        ]

    async def hold(self, name: str) -> str:
        """Take the lease if it is free, renew it if ours; returns the router holding it."""
        owner = await self._hold(keys=self._keys(name)[:1], args=[self.router, self.ttl_ms])
        return owner.decode() if isinstance(owner, bytes) else str(owner)

    async def release(self, name: str) -> None:
        await self._release(keys=self._keys(name), args=[self.router])

    async def publish(self, name: str, view: dict[str, Any]) -> bool:
        """Publish our view of a deployment we hold (False: we do not hold it)."""
        body = json.dumps(view, separators=(",", ":"))
        done = await self._publish(keys=self._keys(name), args=[self.router, self.ttl_ms, body])
        return bool(done)

    async def held(self, names: list[str]) -> dict[str, Held]:
        """Who runs each of ``names`` (absent: nobody) and their published views."""
        if not names:
            return {}
        keys = [k for name in names for k in self._keys(name)]
        values = await self._redis.mget(keys)
        out: dict[str, Held] = {}
        for i, name in enumerate(names):
            owner, view = values[2 * i], values[2 * i + 1]
            if owner is not None:
                router = owner.decode() if isinstance(owner, bytes) else str(owner)
                out[name] = Held(router, json.loads(view) if view is not None else None)
        return out
