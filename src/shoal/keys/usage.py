"""Tokens and requests per key, model and hour: counted in memory, written in batches.

The router counts each finished job in memory (``UsageBuffer.add``, no I/O) and a background
task writes the totals every few seconds as one upsert per (key, model, hour), adding to
what is there, so any number of routers can write the same rows. Rows are written in primary
key order so two routers flushing together cannot deadlock on PostgreSQL.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from shoal.keys.records import UsageRow
from shoal.keys.tables import api_keys, usage

log = logging.getLogger(__name__)

BucketKey = tuple[str, str, datetime]  # key id, model, hour


def hour_start(moment: datetime) -> datetime:
    """The hour bucket a moment falls in (UTC)."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass
class Counts:
    requests: int = 0
    tokens_in: int = 0
    tokens_out: int = 0


class UsageBuffer:
    """Pending counts; thread-safe, so a flush in a worker thread can take them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[BucketKey, Counts] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self,
        key_id: str,
        model: str,
        requests: int,
        tokens_in: int,
        tokens_out: int,
        now: datetime | None = None,
    ) -> None:
        if min(requests, tokens_in, tokens_out) < 0:
            raise ValueError("usage counts cannot be negative")
        bucket = (key_id, model, hour_start(now or datetime.now(UTC)))
        with self._lock:
            counts = self._pending.setdefault(bucket, Counts())
            counts.requests += requests
            counts.tokens_in += tokens_in
            counts.tokens_out += tokens_out

    def take(self) -> dict[BucketKey, Counts]:
        with self._lock:
            batch, self._pending = self._pending, {}
        return batch

    def put_back(self, batch: dict[BucketKey, Counts]) -> None:
        """Return a batch that could not be written, to be added to the next flush."""
        with self._lock:
            for bucket, more in batch.items():
                counts = self._pending.setdefault(bucket, Counts())
                counts.requests += more.requests
                counts.tokens_in += more.tokens_in
                counts.tokens_out += more.tokens_out


def write_usage(conn: Connection, batch: dict[BucketKey, Counts]) -> None:
    """Add ``batch`` to the stored totals, in one transaction (the caller's)."""
    if not batch:
        return
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    insert = dialect.insert(usage)
    statement = insert.on_conflict_do_update(
        index_elements=[usage.c.key_id, usage.c.model, usage.c.period_start],
        set_={
            "requests": usage.c.requests + insert.excluded.requests,
            "tokens_in": usage.c.tokens_in + insert.excluded.tokens_in,
            "tokens_out": usage.c.tokens_out + insert.excluded.tokens_out,
        },
    )
    rows = [
        {
            "key_id": key_id,
            "model": model,
            "period_start": hour,
            "requests": c.requests,
            "tokens_in": c.tokens_in,
            "tokens_out": c.tokens_out,
        }
        for (key_id, model, hour), c in sorted(batch.items(), key=lambda item: item[0])
    ]
    for row in rows:  # one statement per row keeps the lock order (and works on both)
        conn.execute(statement, row)


def read_usage(
    conn: Connection,
    since: datetime | None = None,
    key_id: str | None = None,
    model: str | None = None,
) -> Sequence[UsageRow]:
    """Totals per key and model over the hours from ``since``'s hour on."""
    first = sa.func.min(usage.c.period_start)
    last = sa.func.max(usage.c.period_start)
    query = (
        sa.select(
            usage.c.key_id,
            api_keys.c.name,
            usage.c.model,
            sa.func.sum(usage.c.requests),
            sa.func.sum(usage.c.tokens_in),
            sa.func.sum(usage.c.tokens_out),
            first,
            last,
        )
        .select_from(usage.join(api_keys, usage.c.key_id == api_keys.c.id))
        .group_by(usage.c.key_id, api_keys.c.name, usage.c.model)
        .order_by(usage.c.key_id, usage.c.model)
    )
    if since is not None:
        query = query.where(usage.c.period_start >= hour_start(since))
    if key_id is not None:
        query = query.where(usage.c.key_id == key_id)
    if model is not None:
        query = query.where(usage.c.model == model)
    return [
        UsageRow(
            key_id=r[0],
            key_name=r[1],
            model=r[2],
            requests=int(r[3]),
            tokens_in=int(r[4]),
            tokens_out=int(r[5]),
            first_hour=r[6],
            last_hour=r[7],
        )
        for r in conn.execute(query)
    ]


_AGO = re.compile(r"^(\d+)\s*(m|min|h|d|w)$", re.IGNORECASE)
_UNITS = {"m": "minutes", "min": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def usage_since(text: str, now: datetime | None = None) -> datetime:
    """``24h`` / ``7d`` / ``90m`` ago, or an ISO date or time (UTC unless it says)."""
    now = now or datetime.now(UTC)
    match = _AGO.match(text.strip())
    if match:
        amount, unit = int(match.group(1)), _UNITS[match.group(2).lower()]
        return now - timedelta(**{unit: amount})
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"not a duration (90m, 24h, 7d, 2w) or an ISO date: {text!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
