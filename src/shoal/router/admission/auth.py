"""Who is calling: API keys (inference), GPU keys (workers) and admin keys (control plane).

Keys come from two places: the flags (``--api-key``, ``--gpu-key``, ``--admin-key``) and the
key database (``shoal keys create``). A scope that never had a key in either place is open
on loopback (revoking every key of a scope closes it: it never opens it); beyond loopback
the router refuses to start without client and worker keys, and the control plane refuses
every call without an admin key. A key that does not exist, or was revoked, gets a 401; a
key that exists but is of another scope (an inference key on the control plane, a worker
key on inference routes) gets a 403 naming the scope the route needs. Keys are compared in
constant time and never logged; a key is named in logs by its id.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import SecretStr
from starlette.datastructures import Headers

from shoal.keys import DatabaseError, KeyRecord, KeyStore, Queueing, Scope
from shoal.router.admission.ratelimit.interface import RateLimits
from shoal.router.errors import Forbidden, Unauthorized, Unavailable
from shoal.security import bearer, matches
from shoal.settings import CLIENT_KEY_VARIABLE

log = logging.getLogger(__name__)

CLIENT_SCOPES = (Scope.INFERENCE, Scope.ADMIN)
WORKER_SCOPES = (Scope.WORKER,)
ADMIN_SCOPES = (Scope.ADMIN,)


@dataclass(frozen=True)
class Principal:
    """The caller of one request. ``key_id`` is None for open access and flag keys, which
    have no limits and no usage record (and queue with a default key's share)."""

    key_id: str | None
    name: str
    limits: RateLimits | None = None
    queueing: Queueing = Queueing()

    @property
    def limited(self) -> bool:
        return self.limits is not None and any(
            v is not None
            for v in (
                self.limits.requests_per_min,
                self.limits.tokens_per_min,
                self.limits.max_streams,
            )
        )


OPEN = Principal(None, "anonymous (no keys configured)")
FLAG_KEY = Principal(None, "a key given by flag")


class KeyCheck:
    def __init__(
        self,
        *,
        api_keys: tuple[SecretStr, ...],
        gpu_keys: tuple[SecretStr, ...],
        admin_keys: tuple[SecretStr, ...] = (),
        store: KeyStore | None = None,
        open_when_keyless: bool = True,
    ) -> None:
        self.api_keys = api_keys
        self.gpu_keys = gpu_keys
        self.admin_keys = admin_keys
        self.store = store
        self.open_when_keyless = open_when_keyless

    async def client(self, headers: Headers) -> Principal:
        """The caller of an inference route (an inference or admin key); 401 otherwise."""
        return await self._check(headers, CLIENT_SCOPES, self.api_keys + self.admin_keys, "API")

    async def admin(self, headers: Headers) -> Principal:
        """The caller of a control-plane route (an admin key); 401/403 otherwise."""
        return await self._check(headers, ADMIN_SCOPES, self.admin_keys, "admin")

    async def worker(self, headers: Headers) -> bool:
        """Whether a connecting worker presents a GPU (worker) key, or none is needed."""
        try:
            await self._check(headers, WORKER_SCOPES, self.gpu_keys, "GPU")
        except (Unauthorized, Forbidden):
            return False
        return True

    async def open_scopes(self) -> list[Scope]:
        """The scopes anyone may use without a key right now: on loopback, those that never
        had a key (``inference`` counts admin keys too, as its routes take them)."""
        if not self.open_when_keyless:
            return []
        checks = (
            (CLIENT_SCOPES, self.api_keys + self.admin_keys),
            (WORKER_SCOPES, self.gpu_keys),
            (ADMIN_SCOPES, self.admin_keys),
        )
        return [scopes[0] for scopes, flags in checks if await self.is_open(scopes, flags)]

    async def is_open(self, scopes: tuple[Scope, ...], flag_keys: tuple[SecretStr, ...]) -> bool:
        """No key of these scopes anywhere: open (loopback) or closed to all (beyond it)."""
        if flag_keys:
            return False
        if self.store is None:
            return True
        return not await self._has_keys(scopes)

    async def _check(
        self,
        headers: Headers,
        scopes: tuple[Scope, ...],
        flag_keys: tuple[SecretStr, ...],
        kind: str,
    ) -> Principal:
        presented = bearer(headers)
        known: Known | None = None
        if presented is not None:
            if flag_keys and matches(presented, flag_keys):
                return FLAG_KEY
            known = await self._known(presented)
            if isinstance(known, KeyRecord) and known.works_for(scopes):
                return _principal(known)
        if await self.is_open(scopes, flag_keys):
            if self.open_when_keyless:
                return OPEN
            raise Forbidden(
                f"This router has no {kind} key, so these routes are closed beyond loopback. "
                f"Create one with `shoal keys create --scope {scopes[0].value}`."
            )
        if presented is None:
            raise Unauthorized(
                f"No {kind} key given. Send it as 'Authorization: Bearer YOUR_KEY' "
                "(or 'x-api-key: YOUR_KEY')."
            )
        if isinstance(known, KeyRecord):  # named by its label: never the secret
            log.debug(
                "key %s (%s%s) refused where %s is needed",
                known.label(),
                known.scope,
                ", revoked" if known.revoked else "",
                "/".join(scopes),
            )
        raise refusal(known, scopes, kind)

    async def _known(self, secret: str) -> Known | None:
        """What the presented key is: a key of the database, a flag key's scope, or None."""
        if self.store is not None:
            try:
                record = await self.store.identify(secret)
            except DatabaseError as exc:
                raise _key_database_down() from exc
            if record is not None:
                return record
        return self._flag_scope(secret)

    def _flag_scope(self, secret: str) -> Scope | None:
        """The scope of the flag key ``secret`` is, if any (each flag compared in full)."""
        found = [
            scope
            for scope, keys in (
                (Scope.INFERENCE, self.api_keys),
                (Scope.WORKER, self.gpu_keys),
                (Scope.ADMIN, self.admin_keys),
            )
            if matches(secret, keys)
        ]
        return found[0] if found else None

    async def _has_keys(self, scopes: tuple[Scope, ...]) -> bool:
        assert self.store is not None
        try:
            return await self.store.has_keys(scopes)
        except DatabaseError as exc:
            raise _key_database_down() from exc


Known = KeyRecord | Scope
"""A key presented that exists: its database record, or the scope of the flag that gave it."""


def refusal(known: Known | None, scopes: tuple[Scope, ...], kind: str) -> Unauthorized | Forbidden:
    """Why a key that is not usable here is refused: 401 for a key that does not exist or was
    revoked, 403 for a key of another scope (saying which scope the route needs)."""
    if known is None:
        return Unauthorized(f"Incorrect {kind} key provided. Check the key you were given.")
    if isinstance(known, KeyRecord) and known.revoked:
        return Unauthorized(
            f"This key ({known.prefix}...) was revoked. Ask the router's administrator for a "
            "new one."
        )
    has = known.scope if isinstance(known, KeyRecord) else known
    needs = " or ".join(s.value for s in scopes)
    return Forbidden(
        f"This key is {_a(has)} {has.value} key; this route needs {_a(scopes[0])} {needs} key "
        f"(`shoal keys create --scope {scopes[0].value}`)."
    )


def _key_database_down() -> Unavailable:
    return Unavailable(
        "The router cannot check keys right now (its key database is unreachable). "
        "Try again shortly.",
        retry_after=5,
    )


def _a(scope: Scope) -> str:
    return "an" if scope.value[0] in "aeiou" else "a"


def _principal(record: KeyRecord) -> Principal:
    return Principal(record.id, record.name or record.prefix, record.limits, record.queueing)


def startup_problem(
    keys: KeyCheck, on_loopback: bool, host: str, client_key_set: bool = False
) -> str | None:
    """Why a router on ``host`` must not start with these keys, or None. Loopback may run
    open; beyond it clients and workers need keys (from flags or the key database).

    ``client_key_set``: ``SHOAL_API_KEY`` is in the environment. A router read it as its
    key before; one that relied on it (on loopback behind a proxy, say) would now start with
    its API routes open, so with no API key it does not start, and says how to give it one.
    """
    clients_keyed = bool(keys.api_keys or keys.admin_keys or _stored(keys, CLIENT_SCOPES))
    if on_loopback and client_key_set and not clients_keyed:
        return (
            f"refusing to start with open API routes while {CLIENT_KEY_VARIABLE} is set: a "
            "router no longer reads it (it is a client's variable), and this one has no API "
            "key. Give the router its key with SHOAL_ROUTER_API_KEY or --api-key (or `shoal "
            f"keys create --scope inference`), or unset {CLIENT_KEY_VARIABLE} to run it open "
            "on loopback."
        )
    if on_loopback:
        return None
    missing = []
    if not clients_keyed:
        missing.append("API keys (--api-key, or `shoal keys create --scope inference`)")
    if not (keys.gpu_keys or _stored(keys, WORKER_SCOPES)):
        missing.append("GPU keys (--gpu-key, or `shoal keys create --scope worker`)")
    if not missing:
        return None
    return (
        f"refusing to listen on {host} without {' and '.join(missing)}: anyone on the network "
        "could use or join this cluster. Create the keys, or listen on 127.0.0.1."
    )


def describe(keys: KeyCheck, sources: Mapping[Scope, str]) -> str:
    """For the start-up log: where each scope's keys come from (flags or variables, named as
    in ``sources``; the key database, counted), or that its routes are open or closed. Keys
    are counted, never shown; a flag key that is a database key was named by ``flag_keys``."""
    store = keys.store
    working = {s: store.count(s) for s in Scope} if store else {}
    ever = {s: store.count(s, revoked=True) for s in Scope} if store else {}
    parts = [
        _scope_keys(name, len(flags), sources[scope], working.get(scope, 0), ever.get(scope, 0))
        for name, flags, scope in (
            ("API", keys.api_keys, Scope.INFERENCE),
            ("GPU", keys.gpu_keys, Scope.WORKER),
            ("admin", keys.admin_keys, Scope.ADMIN),
        )
    ]
    if keys.api_keys or keys.gpu_keys or keys.admin_keys:
        parts.append(
            "keys given by flag or variable are valid until this router stops "
            "(`shoal keys revoke` reaches only the database's)"
        )
    return "; ".join(parts)


def _scope_keys(name: str, flags: int, source: str, stored: int, ever: int) -> str:
    origins = [f"{flags} from {source}"] if flags else []
    if stored:
        origins.append(f"{stored} in the key database")
    if origins:
        return f"{name} keys: {' and '.join(origins)}"
    if ever:
        return f"every {name} key revoked: {name} routes closed"
    return f"no {name} key: {name} routes open"


def _stored(keys: KeyCheck, scopes: tuple[Scope, ...]) -> bool:
    return keys.store is not None and any(keys.store.count(s) for s in scopes)
