"""The one checked lifecycle (``shoal.lifecycle``) and every state machine declared with it.

The shared table on a small machine of its own: each legal move passes, every illegal pair
raises ``IllegalTransition`` naming the machine and both states, each move logs one line.
Then the router's machines, their expected moves written out from the diagrams in their
modules' docstrings and checked over every pair of states (the worker's are in
``worker/test_lifecycle.py``). Last, every table declared anywhere in ``src/shoal`` is found
by reading the source, so a new machine cannot go unchecked: each must be closed and listed
here or there."""

from __future__ import annotations

import enum
import importlib
import itertools
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from shoal.lifecycle import IllegalTransition, Lifecycle, Transitions
from shoal.protocol.ids import JobId, ModelName, WorkerId
from shoal.protocol.messages import Endpoint
from shoal.router.async_jobs import records
from shoal.router.async_jobs.records import AsyncJobId, JobRecord, JobStatus, JobType
from shoal.router.deployments import deployment
from shoal.router.deployments.deployment import DeploymentState
from shoal.router.dispatch import job
from shoal.router.dispatch.job import Job, JobState
from shoal.router.dispatch.workers import ALLOWED as CONNECTION
from shoal.router.dispatch.workers import ConnState
from shoal.worker.images import service as image_service
from shoal.worker.link import redis_pull
from shoal.worker.link import router_link as link
from shoal.worker.shards import host as shards
from shoal.worker.text import attached, llama_server


class Light(enum.StrEnum):
    OFF = "off"
    ON = "on"
    BROKEN = "broken"


LIGHT = Transitions(
    {Light.OFF: {Light.ON}, Light.ON: {Light.OFF, Light.BROKEN}, Light.BROKEN: set()}
)
LIGHT_MOVES = {(Light.OFF, Light.ON), (Light.ON, Light.OFF), (Light.ON, Light.BROKEN)}


@pytest.mark.parametrize(("old", "new"), list(itertools.product(Light, repeat=2)))
def test_a_move_is_allowed_or_raises_naming_machine_and_states(old: Light, new: Light) -> None:
    life = Lifecycle("light 7", LIGHT, old, logging.getLogger(__name__))
    if (old, new) in LIGHT_MOVES:
        life.move(new)
        assert life.state is new
        return
    with pytest.raises(IllegalTransition, match=f"^light 7: {old} -> {new} is not allowed$") as e:
        life.move(new)
    assert (e.value.who, e.value.old, e.value.new) == ("light 7", old, new)
    assert life.state is old


def test_each_move_logs_one_line_at_the_tables_level(caplog: pytest.LogCaptureFixture) -> None:
    quiet = Transitions(dict(LIGHT), level=logging.DEBUG)
    log = logging.getLogger("t")
    with caplog.at_level(logging.INFO, logger="t"):
        assert LIGHT.move("light 7", Light.OFF, Light.ON, "switched", log) is Light.ON
        quiet.move("light 8", Light.OFF, Light.ON, "not at INFO", log)
        with pytest.raises(IllegalTransition):
            LIGHT.move("light 7", Light.BROKEN, Light.ON, "", log)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "light 7: off -> on switched")
    ]


def test_a_table_is_checked_as_it_is_declared() -> None:
    with pytest.raises(ValueError, match=r"Light: the transition table leaves out \[<Light.BROKEN"):
        Transitions({Light.OFF: {Light.ON}, Light.ON: {Light.OFF}})
    with pytest.raises(ValueError, match="Light: the transition table names"):
        Transitions({Light.OFF: {JobState.QUEUED}, Light.ON: set(), Light.BROKEN: set()})  # a typo
    assert LIGHT.terminal(Light.BROKEN) and not LIGHT.terminal(Light.ON)
    assert LIGHT.sources(Light.OFF) == (Light.ON,) and LIGHT.sources(Light.ON) == (Light.OFF,)


D, J, C, A = DeploymentState, JobState, ConnState, JobStatus

ROUTER: dict[str, tuple[Mapping[enum.Enum, frozenset[enum.Enum]], set[tuple[enum.Enum, ...]]]]
ROUTER = {
    "job": (
        job.ALLOWED,
        {
            (J.QUEUED, J.ASSIGNED),
            (J.QUEUED, J.FAILED),  # refused before a worker took it
            (J.QUEUED, J.CANCELLED),
            (J.ASSIGNED, J.STREAMING),
            (J.ASSIGNED, J.QUEUED),  # requeued: its worker was lost before any output
            (J.ASSIGNED, J.SUCCEEDED),  # an answer in one piece (not streamed)
            (J.ASSIGNED, J.FAILED),
            (J.ASSIGNED, J.CANCELLED),
            (J.STREAMING, J.SUCCEEDED),
            (J.STREAMING, J.FAILED),
            (J.STREAMING, J.CANCELLED),
            (J.STREAMING, J.QUEUED),  # resumed elsewhere after its worker was lost mid-answer
        },
    ),
    "worker connection": (
        CONNECTION,
        {(C.OPEN, C.ACTIVE), (C.OPEN, C.CLOSED), (C.ACTIVE, C.CLOSED)},
    ),
    "deployment": (
        deployment.ALLOWED,
        {
            (D.PENDING, D.STARTING),
            (D.PENDING, D.PENDING),  # still waiting, maybe for another reason
            (D.STARTING, D.SERVING),
            (D.STARTING, D.DEGRADED),
            (D.STARTING, D.PENDING),
            (D.SERVING, D.DEGRADED),
            (D.SERVING, D.PENDING),  # undone by another router
            (D.SERVING, D.DRAINING),  # rebalanced: answers in flight finish first
            (D.DRAINING, D.PENDING),  # then it switches to the new plan
            (D.DRAINING, D.DEGRADED),
            (D.DRAINING, D.DRAINING),
            (D.DEGRADED, D.STARTING),
            (D.DEGRADED, D.PENDING),
            (D.DEGRADED, D.DEGRADED),
        },
    ),
    "async job": (
        records.ALLOWED,
        {
            (A.QUEUED, A.RUNNING),
            (A.QUEUED, A.FAILED),
            (A.QUEUED, A.CANCELLED),
            (A.RUNNING, A.SUCCEEDED),
            (A.RUNNING, A.FAILED),
            (A.RUNNING, A.CANCELLED),
        },
    ),
}
"""Per router machine: its table, and the moves it must allow (every other one raises)."""

STATES: dict[str, type[enum.Enum]] = {"job": J, "worker connection": C, "deployment": D}
PAIRS = [
    (name, old, new)
    for name in ROUTER
    for old, new in itertools.product(STATES.get(name, A), repeat=2)
]


@pytest.mark.parametrize(
    ("name", "old", "new"), PAIRS, ids=[f"{n}:{o.value}->{w.value}" for n, o, w in PAIRS]
)
def test_every_router_move_is_allowed_or_raises(name: str, old: enum.Enum, new: enum.Enum) -> None:
    table, allowed = ROUTER[name]
    assert isinstance(table, Transitions)
    if (old, new) in allowed:
        table.check(name, old, new)
    else:
        with pytest.raises(IllegalTransition, match=f"{name}: {old} -> {new} is not allowed"):
            table.check(name, old, new)


def test_a_jobs_move_logs_its_ids(caplog: pytest.LogCaptureFixture) -> None:
    a_job = Job(JobId("j1"), ModelName("m"), Endpoint.CHAT, False, {}, worker_id=WorkerId("w1"))
    with caplog.at_level(logging.DEBUG, logger=job.__name__):
        a_job.transition(JobState.ASSIGNED, "placed")
    assert caplog.messages == ["job j1 model=m worker=w1: queued -> assigned placed"]
    assert a_job.assigned.is_set()
    with pytest.raises(IllegalTransition, match="job j1 model=m worker=w1: assigned -> assigned"):
        a_job.transition(JobState.ASSIGNED)


def test_an_async_jobs_record_moves_only_by_its_table() -> None:
    rec = JobRecord(AsyncJobId("ajob_1"), JobType.EMBEDDING, "m", None, 1.0)
    with pytest.raises(IllegalTransition, match="async job ajob_1 model=m: queued -> succeeded"):
        rec.moved(JobStatus.SUCCEEDED)
    assert rec.moved(JobStatus.RUNNING).status is JobStatus.RUNNING


SRC = Path(__file__).resolve().parents[1] / "src"
DECLARED = re.compile(r"^(\w+) = Transitions\(", re.MULTILINE)


def declared_tables() -> list[tuple[str, Transitions[enum.Enum]]]:
    """Every module-level ``X = Transitions(...)`` in ``src/shoal``, by reading the source (so
    a moved or new module is found too)."""
    found = []
    for path in sorted((SRC / "shoal").rglob("*.py")):
        names = DECLARED.findall(path.read_text(encoding="utf-8"))
        if names:
            module = importlib.import_module(".".join(path.relative_to(SRC).with_suffix("").parts))
            found += [(f"{module.__name__}.{name}", getattr(module, name)) for name in names]
    return found


WORKER_TABLES = [
    llama_server.ALLOWED,
    attached.ALLOWED,
    image_service.ALLOWED,
    link.ALLOWED,
    redis_pull.ALLOWED,
    shards.ALLOWED,
]
"""Checked pair by pair in ``worker/test_lifecycle.py``."""


def test_every_declared_table_is_closed_and_checked_pair_by_pair() -> None:
    tables = declared_tables()
    assert len(tables) >= len(ROUTER) + len(WORKER_TABLES)
    covered = [t for t, _ in ROUTER.values()] + WORKER_TABLES
    for name, table in tables:
        states = set(table.states)
        assert set(table) == states, name
        for old, targets in table.items():
            assert targets <= states, f"{name}: {old} -> {targets - states}"
        assert any(table is t for t in covered), f"{name}: add its expected moves to a test"
