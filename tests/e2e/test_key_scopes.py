"""A key is refused for what it is: unknown or revoked, 401; known but of another scope, 403
naming the scope the route needs and the one the key has (the README's "403 control plane
without an admin key"). Database keys and flag keys alike. And ``/api/v1/usage`` takes a
key by name and says from when it counts (usage is kept per hour).

A real router process (no worker: every refusal comes before a job exists), its keys made by
the real CLI in its own process, on the router's SQLite file.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

import http_calls
from cluster import API_KEY, GPU_KEY, MODEL, Cluster, Router, keys_cli
from shoal.keys.usage import hour_start

pytestmark = pytest.mark.e2e

ADMIN_FLAG_KEY = "admin-test-flag-key"
CONTROL_PLANE = [
    "/metrics",
    "/api/v1/workers",
    "/api/v1/usage",
    "/api/v1/pipeline/status",
    "/api/v1/autoscaling",
]
ASK = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def new_key(database_url: str, scope: str, *name: str) -> str:
    """A new key's secret (the last line `shoal keys create` prints)."""
    return keys_cli(database_url, "create", "--scope", scope, *name).splitlines()[-1]


def error(router: Router, method: str, path: str, key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = ASK if method == "POST" else None
    r = http_calls.request(method, router.url + path, json=body, headers=headers, timeout=10)
    message = str(r.json()["error"]["message"]) if r.status_code >= 400 else ""
    return r.status_code, message


def test_a_known_key_of_another_scope_is_403_an_unknown_or_revoked_one_401(
    cluster: Cluster,
) -> None:
    url = cluster.database_url
    inference, worker, admin = (new_key(url, s) for s in ("inference", "worker", "admin"))
    revoked = new_key(url, "admin")
    keys_cli(url, "revoke", revoked[:17])
    router = cluster.router("--admin-key", ADMIN_FLAG_KEY)  # with --api-key and --gpu-key

    for path in CONTROL_PLANE:
        for key, has in (
            (inference, "an inference"),
            (API_KEY, "an inference"),
            (GPU_KEY, "a worker"),
        ):
            status, message = error(router, "GET", path, key)
            assert status == 403, (path, has, status, message)
            assert f"is {has} key" in message and "needs an admin key" in message, message
        assert error(router, "GET", path, admin)[0] == 200
        assert error(router, "GET", path, ADMIN_FLAG_KEY)[0] == 200
        status, message = error(router, "GET", path, "ak-shoal-not-a-key")
        assert status == 401 and "Incorrect admin key" in message, message
        status, message = error(router, "GET", path, revoked)
        assert status == 401 and "revoked" in message, message
        assert error(router, "GET", path, None)[0] == 401

    chat = "/v1/chat/completions"
    for key in (worker, GPU_KEY):
        status, message = error(router, "POST", chat, key)
        assert status == 403, (key == GPU_KEY, status, message)
        assert "is a worker key" in message and "needs an inference or admin key" in message
    assert error(router, "POST", chat, "sk-shoal-not-a-key")[0] == 401
    assert error(router, "POST", chat, revoked)[0] == 401
    # The keys that may call it get past the key check (to a 404: no worker serves anything).
    for key in (inference, API_KEY, admin, ADMIN_FLAG_KEY):
        assert error(router, "POST", chat, key)[0] == 404
    log = router.proc.log()
    for secret in (inference, worker, admin, revoked, ADMIN_FLAG_KEY):
        assert secret not in log


def test_usage_takes_a_key_by_name_and_says_it_counts_whole_hours(cluster: Cluster) -> None:
    url = cluster.database_url
    admin = new_key(url, "admin")
    new_key(url, "inference", "--name", "app")
    router = cluster.router()
    headers = {"Authorization": f"Bearer {admin}"}
    before = datetime.now(UTC) - timedelta(minutes=5)
    r = http_calls.get(router.url + "/api/v1/usage?since=5m&key=app", headers=headers, timeout=10)
    after = datetime.now(UTC) - timedelta(minutes=5)
    assert r.status_code == 200, r.text
    counted_from = datetime.fromisoformat(r.json()["since"])
    assert counted_from in {hour_start(before), hour_start(after)}  # not 5 minutes ago
    assert r.json()["data"] == []
    r = http_calls.get(router.url + "/api/v1/usage?key=nobody", headers=headers, timeout=10)
    assert r.status_code == 400 and "no key has the id, prefix or name" in r.text
