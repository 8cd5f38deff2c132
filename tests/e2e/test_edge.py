"""The edge as a team runs it: two routers on one PostgreSQL key database and one Redis share
keys, rate limits and usage; a revoked key fails on both at once; metrics are behind the
admin key. Real router, worker, PostgreSQL and Redis processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

import http_calls
from cluster import MODEL, Cluster, clean_env, wait_until

pytestmark = pytest.mark.e2e

CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def shoal_keys(database_url: str, *args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "shoal", "keys", *args, "--json"],
        env=clean_env(SHOAL_DATABASE_URL=database_url),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    created: dict[str, object] = json.loads(out)
    return created


def chat(url: str, key: str) -> httpx.Response:
    return http_calls.post(
        url + "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_two_routers_share_keys_limits_and_revocation(
    cluster: Cluster, pg_url: str, redis_prefix: str
) -> None:
    shared = ("--database-url", pg_url, "--redis-url", "redis://127.0.0.1:6379/0")
    routers = [
        cluster.router(*shared, "--redis-prefix", redis_prefix, api_key=None) for _ in range(2)
    ]
    for i, router in enumerate(routers):
        cluster.worker(router, name=f"w{i}")
    admin = str(shoal_keys(pg_url, "create", "--scope", "admin", "--name", "ops")["secret"])
    for router in routers:
        router.api_key = admin  # the admin key may call everything, /api/v1/workers included
        router.wait_workers(1)

    # A key created once works on both routers.
    limited = shoal_keys(pg_url, "create", "--scope", "inference", "--rate", "3rpm")
    key = str(limited["secret"])
    a, b = (r.url for r in routers)
    assert [chat(u, key).status_code for u in (a, b, a)] == [200, 200, 200]
    # Its 3 requests/min are spent on both together: the fourth is refused on either.
    refused = chat(b, key)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert chat(a, key).status_code == 429

    # A revoked key fails on both routers at once.
    second = shoal_keys(pg_url, "create", "--scope", "inference")
    other = str(second["secret"])
    assert chat(a, other).status_code == 200 and chat(b, other).status_code == 200
    revoked_at = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "shoal", "keys", "revoke", str(second["id"])],
        env=clean_env(SHOAL_DATABASE_URL=pg_url),
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert [chat(u, other).status_code for u in (a, b)] == [401, 401]
    assert time.monotonic() - revoked_at < 10

    # Usage from both routers adds up per key; the admin key reads it, the inference key not.
    usage = wait_until(
        lambda: _usage_for(a, admin, str(limited["id"])), 30, "usage of the limited key"
    )
    assert usage["requests"] == 3 and usage["tokens_out"] >= 3 and usage["tokens_in"] > 0
    denied = http_calls.get(a + "/api/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert denied.status_code == 403  # a known key, of another scope

    # Metrics need the admin key and count what happened.
    assert http_calls.get(a + "/metrics").status_code == 401
    metrics = http_calls.get(a + "/metrics", headers={"Authorization": f"Bearer {admin}"}).text
    assert 'shoal_requests_total{route="/v1/chat/completions",status="429"}' in metrics
    assert f'shoal_tokens_total{{direction="out",model="{MODEL}"}}' in metrics


def _usage_for(url: str, admin: str, key_id: str) -> dict[str, int] | None:
    r = http_calls.get(url + "/api/v1/usage", headers={"Authorization": f"Bearer {admin}"})
    r.raise_for_status()
    rows = [row for row in r.json()["data"] if row["key_id"] == key_id]
    if not rows:
        return None
    row: dict[str, int] = rows[0]
    return row if row["requests"] >= 3 else None
