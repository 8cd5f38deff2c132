"""`shoal keys revoke` is felt on the next request by every running router: real router
processes, the real CLI in its own process, the default SQLite file and PostgreSQL.

The defect this guards: revoking the only key of a scope made a loopback router *open* (a
scope with no working key was taken for a scope that never had one), so the revoked key, and
any other string, kept working until another key was created.
"""

from __future__ import annotations

import pytest

import http_calls
from cluster import Cluster, Router, keys_cli


def create(database_url: str, name: str) -> str:
    """A new inference key's secret (the last line `shoal keys create` prints)."""
    return keys_cli(database_url, "create", "--scope", "inference", "--name", name).splitlines()[-1]


def status(router: Router, secret: str | None) -> int:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return http_calls.get(f"{router.url}/v1/models", headers=headers, timeout=10).status_code


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_revoked_key_is_refused_on_the_next_request_by_every_router(
    cluster: Cluster, database: str, request: pytest.FixtureRequest
) -> None:
    url = cluster.database_url if database == "sqlite" else request.getfixturevalue("pg_url")
    only = create(url, "only")
    routers = [cluster.router("--database-url", url, api_key=None, gpu_key=None) for _ in range(2)]
    for router in routers:
        assert status(router, only) == 200
        assert status(router, only) == 200  # now from the router's cache

    # The first change after start-up, and the only key of its scope.
    keys_cli(url, "revoke", only)
    for router in routers:
        assert status(router, only) == 401, router.proc.log()[-2000:]
        # Revoking every key closes the door; it does not open it to anyone.
        assert status(router, None) == 401
        assert status(router, "sk-shoal-anything") == 401

    # Later changes: one key of several.
    kept, dropped = create(url, "kept"), create(url, "dropped")
    for router in routers:
        assert status(router, dropped) == 200 and status(router, kept) == 200
    keys_cli(url, "revoke", dropped)
    for router in routers:
        assert status(router, dropped) == 401
        assert status(router, kept) == 200
    keys_cli(url, "revoke", kept)
    for router in routers:
        assert status(router, kept) == 401


def test_a_client_variable_opens_no_router(
    cluster: Cluster, pg_url: str, request: pytest.FixtureRequest
) -> None:
    """A shell where a client exported its key (SHOAL_API_KEY, as the quick start once said,
    or OPENAI_API_KEY) starts a router of another site, on another database: that key is not
    one of its keys. Before, the router read SHOAL_API_KEY as --api-key and answered the
    other database's key with 200, a key `shoal keys revoke` could not remove there."""
    elsewhere = create(cluster.database_url, "laptop")  # the SQLite site's key
    exported = {"SHOAL_API_KEY": elsewhere, "OPENAI_API_KEY": elsewhere}
    own = create(pg_url, "site-b")  # (with no key at all it would not start: test_cli.py)
    router = cluster.router(
        "--database-url", pg_url, api_key=None, gpu_key=None, env=exported
    )  # fmt: skip
    assert status(router, elsewhere) == 401
    assert status(router, own) == 200
    log = router.proc.log()
    assert log.count("SHOAL_API_KEY is set here and ignored") == 1, log[-3000:]
    assert "--api-key/SHOAL_ROUTER_API_KEY" in log  # what to use instead
    assert "from --api-key" not in log  # the start-up line: no key came from a flag
    assert elsewhere not in log and own not in log


@pytest.mark.parametrize("given", ["flag", "variable"])
def test_a_database_key_given_as_a_flag_stays_revocable(cluster: Cluster, given: str) -> None:
    """A key of the database given by flag (or the router's own variable) is still checked in
    the database, so a revoke reaches it; a key that is only a flag's is named by where it came
    from at start (never shown) and lasts until the router stops."""
    url = cluster.database_url
    secret = create(url, "operator")
    keys = f"{secret},sk-flag-only"
    if given == "flag":
        router = cluster.router("--api-key", keys, api_key=None, gpu_key=None)
    else:
        router = cluster.router(api_key=keys, gpu_key=None)  # SHOAL_ROUTER_API_KEY
    assert status(router, secret) == 200 and status(router, "sk-flag-only") == 200
    log = router.proc.log()
    assert "--api-key/SHOAL_ROUTER_API_KEY holds key_" in log, log[-3000:]
    line = "API keys: 1 from --api-key/SHOAL_ROUTER_API_KEY and 1 in the key database"
    assert line in log
    assert secret not in log and "sk-flag-only" not in log
    keys_cli(url, "revoke", secret)
    assert status(router, secret) == 401
    assert status(router, "sk-flag-only") == 200
