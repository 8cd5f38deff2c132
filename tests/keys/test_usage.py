"""Usage per key, model and hour: counted in memory, flushed as upserts, summed on read."""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta, timezone

import pytest
from keydb import StoreFactory, running

from shoal.keys import DatabaseError, Scope
from shoal.keys.usage import UsageBuffer, hour_start

T0 = datetime(2025, 3, 1, 10, 17, 42, tzinfo=UTC)


def test_hour_buckets() -> None:
    assert hour_start(T0) == datetime(2025, 3, 1, 10, tzinfo=UTC)
    assert hour_start(T0 + timedelta(minutes=50)) == datetime(2025, 3, 1, 11, tzinfo=UTC)
    paris = timezone(timedelta(hours=1))
    assert hour_start(T0.astimezone(paris)) == datetime(2025, 3, 1, 10, tzinfo=UTC)


def test_buffer_adds_per_bucket_and_refuses_negatives() -> None:
    buf = UsageBuffer()
    buf.add("k", "m", 1, 10, 5, now=T0)
    buf.add("k", "m", 1, 3, 2, now=T0 + timedelta(minutes=30))
    buf.add("k", "m", 1, 1, 1, now=T0 + timedelta(hours=1))
    with pytest.raises(ValueError, match="negative"):
        buf.add("k", "m", 1, -1, 0)
    batch = buf.take()
    assert len(buf) == 0
    counts = batch[("k", "m", hour_start(T0))]
    assert (counts.requests, counts.tokens_in, counts.tokens_out) == (2, 13, 7)
    assert len(batch) == 2
    buf.put_back(batch)
    buf.add("k", "m", 1, 1, 1, now=T0)
    assert buf.take()[("k", "m", hour_start(T0))].requests == 3


def test_flush_and_aggregate_by_key_and_model(db_url: str, stores: StoreFactory) -> None:
    store = stores(db_url)
    a, _ = store.create(Scope.INFERENCE, "alice")
    b, _ = store.create(Scope.INFERENCE, "bob")
    add = store.record_usage  # explicit times, to spread the counts over hours
    add(a.id, "qwen", 1, 100, 20, at=T0)
    add(a.id, "qwen", 2, 50, 10, at=T0 + timedelta(hours=2))
    add(a.id, "llama", 1, 7, 3, at=T0)
    add(b.id, "qwen", 4, 40, 40, at=T0 + timedelta(hours=1))
    assert store.flush_usage() == 4
    assert store.flush_usage() == 0  # nothing pending any more

    rows = {(r.key_name, r.model): r for r in store.usage()}
    assert set(rows) == {("alice", "qwen"), ("alice", "llama"), ("bob", "qwen")}
    qwen = rows[("alice", "qwen")]
    assert (qwen.requests, qwen.tokens_in, qwen.tokens_out) == (3, 150, 30)
    assert qwen.first_hour == hour_start(T0)
    assert qwen.last_hour == hour_start(T0 + timedelta(hours=2))

    recent = store.usage(since=T0 + timedelta(minutes=70))  # from 11:00 on
    assert {(r.key_name, r.model, r.requests) for r in recent} == {
        ("alice", "qwen", 2),
        ("bob", "qwen", 4),
    }
    assert [r.key_name for r in store.usage(key=b.id)] == ["bob"]
    assert {r.key_name for r in store.usage(model="llama")} == {"alice"}


def test_flushes_add_to_stored_rows_from_any_store(db_url: str, stores: StoreFactory) -> None:
    first, second = stores(db_url), stores(db_url)
    key, _ = first.create(Scope.INFERENCE)
    for store in (first, second, first):
        store.record_usage(key.id, "m", 1, 10, 1, at=T0)
        store.flush_usage()
    [row] = second.usage()
    assert (row.requests, row.tokens_in, row.tokens_out) == (3, 30, 3)


def test_usage_survives_revocation_and_record_usage_counts_now(
    db_url: str, stores: StoreFactory
) -> None:
    store = stores(db_url)
    key, _ = store.create(Scope.INFERENCE)
    store.record_usage(key.id, "m", 1, 5, 6)
    assert store.pending_usage == 1
    store.revoke(key.id)
    store.flush_usage()
    [row] = store.usage(since=datetime.now(UTC) - timedelta(hours=1))
    assert (row.key_id, row.requests, row.tokens_in, row.tokens_out) == (key.id, 1, 5, 6)


async def test_background_writer_flushes_without_being_asked(
    db_url: str, stores: StoreFactory
) -> None:
    store = stores(db_url, flush_interval=0.05)
    key, _ = store.create(Scope.INFERENCE)
    async with running(store):
        rounds = store.flushes
        store.record_usage(key.id, "m", 1, 2, 3)
        await asyncio.wait_for(store.wait_flushes(rounds + 1), 5)
        assert store.pending_usage == 0
        [row] = await asyncio.to_thread(store.usage)
        assert row.tokens_out == 3


def test_close_writes_what_is_pending(db_url: str, stores: StoreFactory) -> None:
    store = stores(db_url)
    key, _ = store.create(Scope.INFERENCE)
    store.record_usage(key.id, "m", 1, 2, 3)
    store.close()
    [row] = stores(db_url).usage()
    assert row.requests == 1


def test_a_failed_flush_keeps_the_counts(sqlite_url: str, stores: StoreFactory) -> None:
    store = stores(sqlite_url)
    key, _ = store.create(Scope.INFERENCE)
    store.record_usage(key.id, "m", 1, 2, 3, at=T0)
    with closing(sqlite3.connect(store.db.sqlite_path)) as conn:
        conn.execute("ALTER TABLE usage RENAME TO usage_away")
    try:
        with pytest.raises(DatabaseError, match="kept in memory"):
            store.flush_usage()
        assert store.pending_usage == 1
        store.record_usage(key.id, "m", 1, 2, 3, at=T0)
    finally:
        with closing(sqlite3.connect(store.db.sqlite_path)) as conn:
            conn.execute("ALTER TABLE usage_away RENAME TO usage")
    assert store.flush_usage() == 1
    [row] = store.usage()
    assert (row.requests, row.tokens_in) == (2, 4)
