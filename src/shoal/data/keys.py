"""Who may read (list, download) and who may write (upload). Constant-time, never logged.

One rule, whether the store runs alone (``shoal data``) or inside a router (``--storage``):
keys come from the flags (``--api-key``/``--admin-key``; a router's ``--api-key``,
``--gpu-key`` and ``--admin-key``) and from the key database (``shoal keys create``) when
there is one (the router's always; ``shoal data --database-url``).

- Reads take a client, worker or admin key. They are open (on loopback) while no inference or
  worker key exists anywhere, flag or database (a revoked one counts: revoking never opens).
- Uploads take an admin key, and are disabled while no admin key exists anywhere.
- A key that does not exist or was revoked gets a 401; a working key of another scope a 403.

The key rules (``bearer``, ``matches``) are every Shoal server's, from ``shoal.security``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pydantic import SecretStr
from starlette.datastructures import Headers

from shoal.data.errors import Forbidden, KeysUnavailable, Unauthorized, UploadsDisabled
from shoal.keys.errors import DatabaseError
from shoal.keys.records import KeyRecord, Scope
from shoal.security import bearer, is_loopback, matches

if TYPE_CHECKING:
    from shoal.keys.store import KeyStore

log = logging.getLogger(__name__)

READ_SCOPES = (Scope.INFERENCE, Scope.WORKER, Scope.ADMIN)
"""Keys that may list and download: clients', workers' and admins'."""
OPENING_SCOPES = (Scope.INFERENCE, Scope.WORKER)
"""Reads are open (on loopback) while no key of these scopes ever existed."""
WRITE_SCOPES = (Scope.ADMIN,)
"""Keys that may upload."""


class StoreAccess(Protocol):
    """Who may read and who may write; raises the store's errors when refused."""

    async def check_read(self, headers: Headers) -> None: ...

    async def check_admin(self, headers: Headers) -> None: ...


@dataclass(frozen=True)
class StoreKeys:
    """``read``: flag keys for listing and downloading. ``admin``: flag keys for uploads (they
    read too). ``database``: the key database, if any. ``open_when_keyless``: reads with no
    read key anywhere are open (loopback), else refused."""

    read: tuple[SecretStr, ...] = ()
    admin: tuple[SecretStr, ...] = ()
    database: KeyStore | None = None
    open_when_keyless: bool = True

    async def check_read(self, headers: Headers) -> None:
        """Raise 401/403 unless reads are open or the request carries a key that reads."""
        presented = bearer(headers)
        record = await self._identify(presented)
        if _accepted(presented, record, self.read + self.admin, READ_SCOPES):
            return
        if not await self._keyed(self.read, OPENING_SCOPES):
            if self.open_when_keyless:
                return
            raise Forbidden(
                "This model store has no API key, so it serves no one beyond loopback. Create "
                "one with `shoal keys create --scope worker` (or give --api-key)."
            )
        if presented is None:
            raise Unauthorized(
                "No API key given. This model store needs one: send it as "
                "'Authorization: Bearer YOUR_KEY' (a worker sends its --gpu-key)."
            )
        raise _refusal(record, READ_SCOPES, "API")

    async def check_admin(self, headers: Headers) -> None:
        """Raise 403 when uploads are disabled or the key is not an admin key, 401 without
        a working key."""
        presented = bearer(headers)
        record = await self._identify(presented)
        if _accepted(presented, record, self.admin, WRITE_SCOPES):
            return
        if not await self._keyed(self.admin, WRITE_SCOPES):
            raise UploadsDisabled(
                "Uploads are disabled: this model store has no admin key. Give it one "
                "(--admin-key, or `shoal keys create --scope admin` in its key database), or "
                "copy the .gguf file into its storage folder."
            )
        if presented is None:
            raise Unauthorized(
                "No admin key given. Uploads need one: send it as 'Authorization: Bearer KEY'."
            )
        raise _refusal(record, WRITE_SCOPES, "admin")

    def startup_problem(self, host: str) -> str | None:
        """Why a store on ``host`` must not start with these keys, or None. Loopback may run
        open; beyond it both reads and uploads need a key (from a flag or the database).
        Blocking (counts the database's keys)."""
        if is_loopback(host):
            return None
        missing = []
        if not (self.read or self._stored(OPENING_SCOPES)):
            missing.append("API keys (--api-key, or `shoal keys create --scope worker`)")
        if not (self.admin or self._stored(WRITE_SCOPES)):
            missing.append("admin keys (--admin-key, or `shoal keys create --scope admin`)")
        if not missing:
            return None
        return (
            f"refusing to listen on {host} without {' and '.join(missing)}: anyone on the "
            "network could download or replace this store's models. Give the keys, or listen "
            "on 127.0.0.1."
        )

    def describe(self, host: str) -> str:
        """For the start-up log: who may read and who may upload (keys counted, never shown)."""
        db = self.database
        readers = len(self.read) + (sum(db.count(s) for s in OPENING_SCOPES) if db else 0)
        admins = len(self.admin) + (db.count(Scope.ADMIN) if db else 0)
        reads = (
            f"reads need a key ({readers} API or worker key(s))"
            if readers
            else "reads open to anyone who can reach " + host
        )
        writes = f"uploads need one of {admins} admin key(s)" if admins else "uploads disabled"
        return f"{reads}; {writes}"

    async def _identify(self, presented: str | None) -> KeyRecord | None:
        if presented is None or self.database is None:
            return None
        try:
            return await self.database.identify(presented)
        except DatabaseError as exc:
            log.warning("cannot check a key: %s", exc)
            raise KeysUnavailable(
                "The model store cannot check keys right now (its key database is "
                "unreachable). Try again shortly.",
                retry_after=5,
            ) from None

    async def _keyed(self, flags: tuple[SecretStr, ...], scopes: tuple[Scope, ...]) -> bool:
        """Whether any key of ``scopes`` exists: a flag, or one ever created in the database."""
        if flags:
            return True
        if self.database is None:
            return False
        try:
            return await self.database.has_keys(scopes)
        except DatabaseError:
            raise KeysUnavailable(
                "The model store cannot check keys right now (its key database is "
                "unreachable). Try again shortly.",
                retry_after=5,
            ) from None

    def _stored(self, scopes: tuple[Scope, ...]) -> bool:
        return self.database is not None and any(self.database.count(s) for s in scopes)


def _accepted(
    presented: str | None,
    record: KeyRecord | None,
    flags: tuple[SecretStr, ...],
    scopes: tuple[Scope, ...],
) -> bool:
    if presented is None:
        return False
    if record is not None:
        return record.works_for(scopes)
    return matches(presented, flags)


def _refusal(
    record: KeyRecord | None, scopes: tuple[Scope, ...], kind: str
) -> Unauthorized | Forbidden:
    """401 for a key that does not exist (or was revoked), 403 for a working key of a scope
    that may not do this."""
    if record is None:
        return Unauthorized(
            f"Incorrect {kind} key provided. Check the key you were given (the store's "
            f"--{'admin' if kind == 'admin' else 'api'}-key, or a key of its key database)."
        )
    if record.revoked:
        return Unauthorized(
            f"This key ({record.prefix}...) was revoked. Ask the store's administrator for a "
            "new one."
        )
    needs = " or ".join(s.value for s in scopes)
    log.debug("key %s (%s) refused where %s is needed", record.label(), record.scope, needs)
    return Forbidden(
        f"This key is of scope {record.scope.value}; this needs a key of scope {needs} "
        f"(`shoal keys create --scope {scopes[0].value}`)."
    )
