"""Every lifecycle on a worker as a table: each (from, to) pair is allowed or raises.

The expected moves are written out here, from the diagrams in each module's docstring, and
checked against the module's own ``ALLOWED`` table over every pair of states."""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Mapping

import pytest

from shoal.lifecycle import IllegalTransition, Lifecycle, Transitions
from shoal.protocol.messages import BackendState
from shoal.protocol.shards import ShardState
from shoal.worker.images import service as image_service
from shoal.worker.link import redis_pull
from shoal.worker.link import router_link as link
from shoal.worker.link.redis_pull import PullState
from shoal.worker.link.router_link import LinkState
from shoal.worker.shards import host as shards
from shoal.worker.text import attached, llama_server

B, L, P, S = BackendState, LinkState, PullState, ShardState

EXPECTED: dict[str, tuple[Mapping[enum.Enum, frozenset[enum.Enum]], set[tuple[enum.Enum, ...]]]]
EXPECTED = {
    "llama-server": (
        llama_server.ALLOWED,
        {
            (B.LOADING, B.READY),
            (B.LOADING, B.RESTARTING),  # exited while loading
            (B.LOADING, B.FAILED),  # ... too often
            (B.READY, B.RESTARTING),
            (B.READY, B.FAILED),  # a head (max_restarts=0) whose stage died
            (B.READY, B.UNLOADED),
            (B.RESTARTING, B.LOADING),
            (B.UNLOADED, B.LOADING),
        },
    ),
    "attached server": (
        attached.ALLOWED,
        {(B.LOADING, B.READY), (B.READY, B.LOADING)},
    ),
    "image model": (
        image_service.ALLOWED,
        {
            (B.LOADING, B.READY),
            (B.LOADING, B.FAILED),
            (B.READY, B.UNLOADED),
            (B.UNLOADED, B.LOADING),
            (B.FAILED, B.LOADING),
        },
    ),
    "router link": (
        link.ALLOWED,
        {
            (L.WAITING, L.CONNECTING),
            (L.CONNECTING, L.REGISTERED),
            (L.CONNECTING, L.WAITING),
            (L.REGISTERED, L.WAITING),
        },
    ),
    "pull worker": (
        redis_pull.ALLOWED,
        {
            (P.STARTING, P.CLAIMING),
            (P.STARTING, P.FULL),
            (P.STARTING, P.PAUSED),
            (P.CLAIMING, P.FULL),
            (P.CLAIMING, P.PAUSED),
            (P.CLAIMING, P.REDIS_DOWN),
            (P.FULL, P.CLAIMING),
            (P.FULL, P.PAUSED),
            (P.PAUSED, P.CLAIMING),
            (P.PAUSED, P.FULL),
            (P.REDIS_DOWN, P.CLAIMING),
            (P.REDIS_DOWN, P.FULL),
            (P.REDIS_DOWN, P.PAUSED),
        },
    ),
    "shard": (
        shards.ALLOWED,
        {
            (S.STARTING, S.READY),
            (S.STARTING, S.FAILED),
            (S.STARTING, S.STOPPED),
            (S.READY, S.FAILED),
            (S.READY, S.STOPPED),
            (S.FAILED, S.STOPPED),
        },
    ),
}
"""Per lifecycle: its table, and the moves it must allow (every other one raises)."""

STATES = {"router link": L, "pull worker": P, "shard": S}

PAIRS = [
    (name, old, new)
    for name in EXPECTED
    for old, new in itertools.product(STATES.get(name, B), repeat=2)
]


@pytest.mark.parametrize(
    ("name", "old", "new"), PAIRS, ids=[f"{n}:{o.value}->{w.value}" for n, o, w in PAIRS]
)
def test_every_move_is_allowed_or_raises(name: str, old: enum.Enum, new: enum.Enum) -> None:
    table, allowed = EXPECTED[name]
    life = Lifecycle(name, table, old, logging.getLogger(__name__))
    if (old, new) in allowed:
        life.move(new, "test")
        assert life.state is new
    else:
        with pytest.raises(IllegalTransition, match=f"{name}: {old} -> {new} is not allowed"):
            life.move(new, "test")
        assert life.state is old


def test_each_move_logs_one_line_naming_what_moved(caplog: pytest.LogCaptureFixture) -> None:
    life = Lifecycle("llama-server qwen", llama_server.ALLOWED, B.LOADING, logging.getLogger("t"))
    with caplog.at_level(logging.INFO, logger="t"):
        life.move(B.READY, "serving on http://127.0.0.1:1")
        with pytest.raises(IllegalTransition):
            life.move(B.LOADING)
    assert [r.getMessage() for r in caplog.records] == [
        "llama-server qwen: loading -> ready serving on http://127.0.0.1:1"
    ]


def test_a_table_must_name_every_state() -> None:
    partial = {B.LOADING: frozenset({B.READY}), B.READY: frozenset()}
    with pytest.raises(ValueError, match="leaves out"):
        Transitions(partial)
