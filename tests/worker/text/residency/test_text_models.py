"""Several text models on one worker, kept by measured memory (``TextModels``): real
llama-servers, two copies of the default model under two aliases, a budget that holds one.

A job for B evicts A and A's next job loads it again; concurrent jobs for one unloaded model
share one load; a job for a model that waits behind a busy one starts once that one's job
ends; a model too big for the budget fails its job with a 503 naming the numbers; each
model's llama-server serves its own ``/slots``; the kv-save hook hears of every eviction and
load.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from shoal.models.residency import Footprint
from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.messages import (
    BackendState,
    Endpoint,
    JobDone,
    JobFailed,
    JobLoading,
    JobResult,
    JobStart,
    ModelInfo,
)
from shoal.worker.jobs.sink import JobOutcome
from shoal.worker.text.llama_server import LlamaServerConfig
from shoal.worker.text.plan import Plan
from shoal.worker.text.residency.budget import estimate_file
from shoal.worker.text.residency.hosted import HostedModel
from shoal.worker.text.residency.models import ModelDoesNotFit, TextModels
from shoal.worker.text.residency.planned import PlannedModel, measured

LOAD_S = 120


class Outcomes:
    """A job sink that keeps what it is given."""

    def __init__(self) -> None:
        self.outcomes: list[JobOutcome] = []
        self.text = ""

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        self.text += data

    def send(self, message: JobOutcome, /) -> None:
        self.outcomes.append(message)


class Keeper:
    """The kv-save hook, as told: (event, model) in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, BackendState]] = []

    async def before_unload(self, host: HostedModel) -> None:
        self.events.append(("before_unload", host.name, host.state))

    async def after_load(self, host: HostedModel) -> None:
        self.events.append(("after_load", host.name, host.state))


def _planned(
    llama_server: Path, model_path: Path, logs: Path, alias: str, budget: Footprint, idle: float
) -> PlannedModel:
    config = LlamaServerConfig(
        binary=llama_server,
        model_path=model_path,
        alias=alias,
        slots=2,
        ctx_size=512,
        log_file=logs / f"llama-server-{alias}.log",
        threads=1,
        max_restarts=0,
        idle_unload_s=idle,
    )
    info = ModelInfo(
        name=ModelName(alias), endpoints=(Endpoint.CHAT, Endpoint.COMPLETIONS), context_length=512
    )
    need = estimate_file(model_path, config.ctx_size * config.slots, budget)
    return PlannedModel(measured(Plan(info, config)), need)


def _job(n: int, model: str) -> JobStart:
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi?"}]}
    return JobStart(
        job_id=JobId(f"j{n}"),
        model=ModelName(model),
        endpoint=Endpoint.CHAT,
        stream=False,
        body=body,
    )


class Rig:
    def __init__(self, models: TextModels) -> None:
        self.models = models
        self.loading: list[JobLoading] = []
        self.states: list[BackendState] = []

    def host(self, name: str) -> HostedModel:
        return self.models.hosts[name]


@pytest.fixture
async def rig(
    llama_server: Path, model_path: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Rig]:
    """Models "a" and "b" (the default model twice), a budget of 1.15 times its first-load
    estimate: one fits; two do not, estimated or measured (the default model measures about
    0.7 of its estimate). A parameter: their idle unload, seconds (default: none)."""
    idle: float = getattr(request, "param", 0.0)
    budget = Footprint(ram=int(estimate_file(model_path, 1024, Footprint(ram=2**40)).ram * 1.15))
    loading: list[JobLoading] = []
    states: list[BackendState] = []
    async with aiohttp.ClientSession() as session:
        models = TextModels(
            [_planned(llama_server, model_path, tmp_path, a, budget, idle) for a in ("a", "b")],
            session,
            budget,
            on_models=lambda: None,
            on_state=lambda state, _detail: states.append(state),
            on_cache=lambda _blocks: None,
            loading=loading.append,
            keeper=Keeper(),
        )
        rig = Rig(models)
        rig.loading, rig.states = loading, states
        task = asyncio.create_task(models.run())
        try:
            yield rig
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _run(rig: Rig, n: int, model: str) -> Outcomes:
    sink = Outcomes()
    async with asyncio.timeout(LOAD_S):
        await rig.models.job_function(model)(_job(n, model), sink)
    return sink


async def test_a_job_for_b_evicts_a_and_as_next_job_loads_it_again(rig: Rig) -> None:
    a, b = rig.host("a"), rig.host("b")
    assert (a.state, b.state) == (BackendState.UNLOADED, BackendState.UNLOADED)
    first = await _run(rig, 1, "a")
    assert [type(o) for o in first.outcomes] == [JobResult]
    assert (a.state, a.server.loads, a.evictions) == (BackendState.READY, 1, 0)
    assert a.measured is not None and a.measured != a.estimate
    assert a.footprint == a.measured  # what llama-server reported replaced the estimate
    assert a.server.load_seconds is not None and a.server.load_seconds > 0

    await _run(rig, 2, "b")
    assert (a.state, a.evictions, b.state, b.server.loads) == (
        BackendState.UNLOADED,
        1,
        BackendState.READY,
        1,
    )
    await _run(rig, 3, "a")
    assert (a.state, a.server.loads, b.state, b.evictions) == (
        BackendState.READY,
        2,
        BackendState.UNLOADED,
        1,
    )
    # Each job that found its model unloaded said so once.
    assert [(m.job_id, m.model) for m in rig.loading] == [("j1", "a"), ("j2", "b"), ("j3", "a")]
    keeper = rig.models.keeper
    assert isinstance(keeper, Keeper)
    assert keeper.events == [
        ("after_load", "a", BackendState.READY),
        ("before_unload", "a", BackendState.READY),
        ("after_load", "b", BackendState.READY),
        ("before_unload", "b", BackendState.READY),
        ("after_load", "a", BackendState.READY),
    ]
    infos = {i.name: i for i in rig.models.infos()}
    assert infos[ModelName("a")].loads == 2 and infos[ModelName("b")].evictions == 1
    assert infos[ModelName("a")].resident_bytes == a.measured.total
    assert infos[ModelName("a")].slots == 2 and rig.models.slots == 4
    assert rig.models.state is BackendState.READY


async def test_concurrent_jobs_for_an_unloaded_model_share_one_load(rig: Rig) -> None:
    sinks = await asyncio.gather(*(_run(rig, n, "a") for n in range(4)))
    assert all([type(o) for o in s.outcomes] == [JobResult] for s in sinks)
    assert rig.host("a").server.loads == 1
    assert len(rig.loading) == 4  # each job was told it waits


async def test_a_model_waits_while_the_one_in_its_way_runs_a_job(rig: Rig) -> None:
    a, b = rig.host("a"), rig.host("b")
    async with asyncio.timeout(LOAD_S), rig.models.hold("a"):
        waiting = asyncio.create_task(_run(rig, 2, "b"))
        await asyncio.sleep(0.5)  # b decided: a is busy, so b waits
        assert not waiting.done() and b.state is BackendState.UNLOADED
        assert a.state is BackendState.READY and a.evictions == 0
    sink = await waiting
    assert [type(o) for o in sink.outcomes] == [JobResult]
    assert (a.state, a.evictions, b.state) == (BackendState.UNLOADED, 1, BackendState.READY)


async def test_a_model_too_big_for_the_budget_fails_its_job_naming_the_numbers(rig: Rig) -> None:
    rig.models.budget = Footprint(ram=2**20)
    sink = await _run(rig, 1, "a")
    [failed] = sink.outcomes
    assert isinstance(failed, JobFailed)
    assert (failed.status, failed.retryable, failed.error.code) == (
        503,
        False,
        "model_does_not_fit",
    )
    assert "model a needs" in failed.error.message and "1.0 MiB" in failed.error.message
    with pytest.raises(ModelDoesNotFit):
        async with rig.models.hold("a"):
            pass
    assert rig.host("a").state is BackendState.UNLOADED and rig.host("a").server.loads == 0


async def test_each_model_serves_its_own_slots(rig: Rig) -> None:
    async with asyncio.timeout(LOAD_S), rig.models.hold("b") as b:
        async with aiohttp.ClientSession() as session, session.get(b.url + "/slots") as r:
            slots = await r.json()
        assert r.status == 200 and len(slots) == b.config.slots
        sink = Outcomes()
        job = _job(7, "b").model_copy(
            update={"stream": True, "body": {**_job(7, "b").body, "stream": True}}
        )
        await b.backend.run(job, sink)
        assert sink.outcomes == [JobDone(job_id=JobId("j7"))] and sink.text


async def test_the_routers_unload_and_load_move_a_text_model(rig: Rig) -> None:
    a = rig.host("a")
    assert rig.models.control("a", "load")
    async with asyncio.timeout(LOAD_S):
        while a.state is not BackendState.READY:
            await a.server.changed.wait()
    assert rig.models.control("a", "unload")
    async with asyncio.timeout(LOAD_S):
        while a.state is not BackendState.UNLOADED:
            await a.server.changed.wait()
    assert a.evictions == 1 and not rig.models.control("nope", "load")


@pytest.mark.parametrize("rig", [1.0], indirect=True)
async def test_a_models_own_idle_unload_frees_it_and_its_next_job_loads_it(rig: Rig) -> None:
    a = rig.host("a")
    await _run(rig, 1, "a")
    async with asyncio.timeout(LOAD_S):
        while a.state is not BackendState.UNLOADED:
            await a.server.changed.wait()
    assert not a.resident and a.evictions == 0  # it went by itself
    keeper = rig.models.keeper
    assert isinstance(keeper, Keeper)  # its slots were saved first, as for an eviction
    assert ("before_unload", "a", BackendState.READY) in keeper.events
    assert rig.models.state is BackendState.UNLOADED  # the router still sends it jobs
    await _run(rig, 2, "a")
    assert (a.state, a.server.loads) == (BackendState.READY, 2)


class SlowKeeper(Keeper):
    """Holds an unload in its slots' save until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.saving = asyncio.Event()
        self.release = asyncio.Event()

    async def before_unload(self, host: HostedModel) -> None:
        await super().before_unload(host)
        self.saving.set()
        await self.release.wait()


async def test_a_job_that_comes_while_its_model_unloads_waits_and_loads_it_again(rig: Rig) -> None:
    """The unload had begun (its slots saving, the model still READY): the job is not let
    through to a llama-server about to stop; it waits, is told it loads, and runs on the
    model loaded again."""
    a = rig.host("a")
    await _run(rig, 1, "a")
    keeper = rig.models.keeper = SlowKeeper()
    assert rig.models.control("a", "unload")
    async with asyncio.timeout(LOAD_S):
        await keeper.saving.wait()
    assert a.state is BackendState.READY and a.unloading
    job = asyncio.create_task(_run(rig, 2, "a"))
    await asyncio.sleep(0.2)
    assert not job.done() and a.server.loads == 1  # it waits; nothing was sent to a
    keeper.release.set()
    second = await job
    assert [type(o) for o in second.outcomes] == [JobResult]
    assert (a.state, a.server.loads, a.evictions) == (BackendState.READY, 2, 1)
    assert [m.job_id for m in rig.loading][-1] == "j2"  # it was told it waits for a load
