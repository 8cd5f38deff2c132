"""No secret ever reaches a log line or an error message, even with every logger at DEBUG.

SQLAlchemy logs its SQL and parameters at DEBUG too, so this also shows that secrets never
travel to the database (only their hashes do).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from keydb import StoreFactory, running

from shoal.keys import KeyStoreError, Scope, ensure_bootstrap_keys
from shoal.keys.secrets import MARKERS


def secret_parts(secret: str) -> list[str]:
    """The secret, and its random part beyond the displayed prefix."""
    marker = next(m for m in MARKERS.values() if secret.startswith(m))
    return [secret, secret[len(marker) + 8 :]]


async def test_no_secret_in_logs_over_a_keys_lifetime(
    db_url: str, stores: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy")  # its SQL and parameters too
    secrets: list[str] = []
    errors: list[str] = []
    store = stores(db_url, flush_interval=0.01)
    async with running(store):
        await asyncio.wait_for(store.wait_listening(), 10)
        made = ensure_bootstrap_keys(store)
        assert made is not None
        secrets += made.values()
        keys = {}
        for scope in Scope:
            key, secret = store.create(scope, f"{scope} key")
            keys[scope] = key
            secrets.append(secret)
        for secret in secrets:
            await store.verify(secret, {Scope.INFERENCE})  # right scope for some, wrong for others
            await store.verify(secret, set(Scope))
        await store.verify(secrets[-1][:-2] + "zz", set(Scope))  # a near miss
        store.revoke(keys[Scope.WORKER].prefix)
        store.revoke(secrets[-1])  # revoke by whole secret
        for secret in secrets:
            await store.verify(secret, set(Scope))
        for wrong in (secrets[0][:-1] + "_", "sk-shoal-"):
            try:
                store.find(wrong)
            except KeyStoreError as exc:
                errors.append(str(exc))
        store.record_usage(keys[Scope.INFERENCE].id, "m", 1, 2, 3)
        await asyncio.wait_for(store.wait_flushes(store.flushes + 1), 5)
    store.close()

    text = caplog.text + "\n".join(errors)
    assert "created inference key" in caplog.text and "revoked worker key" in caplog.text
    assert "FROM api_keys" in caplog.text  # SQLAlchemy logged its statements and parameters
    assert keys[Scope.ADMIN].prefix in caplog.text  # keys are named by their prefix ...
    for secret in secrets:
        for part in secret_parts(secret):
            assert part not in text  # ... and never by their secret
    assert len(errors) == 2
