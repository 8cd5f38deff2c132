"""Switching between a worker's image models on request: which one is unloaded (pure), and the
switch itself with FAKE engines (the real diffusers one is switched in tests/e2e/test_images.py)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.protocol.ids import JobId, ModelName
from shoal.protocol.images import ImageJob
from shoal.protocol.messages import BackendState, Endpoint, JobFailed, JobResult, JobStart
from shoal.worker.images.engine import GeneratedImage, Generation, StepCallback
from shoal.worker.images.models import ImageModels, Resident, combined_state, to_unload
from shoal.worker.jobs.sink import JobOutcome

R = BackendState.READY


@pytest.mark.parametrize(
    ("resident", "wanted", "max_loaded", "unload"),
    [
        ([], "a", 1, []),
        ([("a", 1.0)], "a", 1, []),
        ([("a", 1.0)], "b", 1, ["a"]),
        ([("a", 1.0), ("b", 2.0)], "c", 2, ["a"]),
        ([("a", 3.0), ("b", 2.0)], "c", 2, ["b"]),
        ([("a", 1.0), ("b", 2.0)], "b", 2, []),
        ([("a", 1.0), ("b", 2.0), ("c", 3.0)], "c", 1, ["a", "b"]),
        ([("a", 1.0), ("b", 1.0)], "c", 1, ["a", "b"]),
    ],
)
def test_the_model_used_longest_ago_makes_room(
    resident: list[tuple[str, float]], wanted: str, max_loaded: int, unload: list[str]
) -> None:
    assert to_unload([Resident(n, t) for n, t in resident], wanted, max_loaded) == unload


def test_the_worker_takes_jobs_while_any_model_does() -> None:
    B = BackendState
    assert combined_state([B.UNLOADED, B.READY]) is B.READY
    assert combined_state([B.UNLOADED, B.FAILED]) is B.UNLOADED
    assert combined_state([B.LOADING, B.FAILED]) is B.LOADING
    assert combined_state([B.FAILED]) is B.FAILED


class FakeEngine:
    """A FAKE image engine that records its loads and unloads in a shared log."""

    backend = "fake"

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.loaded = name, log, False

    async def load(self) -> None:
        self.log.append(f"load {self.name}")
        self.loaded = True

    async def unload(self) -> None:
        if self.loaded:
            self.log.append(f"unload {self.name}")
        self.loaded = False

    async def generate(self, job: ImageJob, seed: int, on_step: StepCallback) -> Generation:
        assert self.loaded
        return Generation((GeneratedImage(self.name.encode(), seed),))


class Sink:
    def __init__(self) -> None:
        self.outcomes: list[JobOutcome] = []

    def chunk(self, job_id: JobId, data: str, tokens: tuple[int, ...] | None = None) -> None:
        pass

    def send(self, message: JobOutcome, /) -> None:
        self.outcomes.append(message)


def _job(model: str) -> JobStart:
    return JobStart(
        job_id=JobId(f"job_{model}"),
        model=ModelName(model),
        endpoint=Endpoint.IMAGE_GENERATIONS,
        stream=False,
        body={"prompt": "x", "seed": 1},
    )


async def test_a_job_for_another_model_switches_to_it() -> None:
    log: list[str] = []
    models = ImageModels(
        [(ModelName(n), FakeEngine(n, log)) for n in ("a", "b")],
        on_models=lambda: None,
        max_loaded=1,
    )
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(models.run())
        a, b = models.services[ModelName("a")], models.services[ModelName("b")]
        await a.wait_for(R)
        assert b.state is BackendState.UNLOADED
        sink = Sink()
        await models.run_job(_job("b"), sink)
        assert isinstance(sink.outcomes[-1], JobResult)
        assert log == ["load a", "unload a", "load b"]
        assert (a.state, b.state) == (BackendState.UNLOADED, R)
        await models.run_job(_job("a"), sink)
        assert log[-2:] == ["unload b", "load a"]
        await models.run_job(_job("nope"), sink)
        failed = sink.outcomes[-1]
        assert isinstance(failed, JobFailed) and failed.status == 404
        task.cancel()
