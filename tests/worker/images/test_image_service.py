"""The image model's state machine: loads at start, unloads when idle or asked, loads again
for the next job. A FAKE engine stands in for diffusers (the real one is tested end to end in
tests/e2e/test_images.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shoal.protocol.ids import ModelName
from shoal.protocol.images import ImageJob
from shoal.protocol.messages import BackendState
from shoal.worker.images.engine import Generation, ImageEngineError, StepCallback
from shoal.worker.images.service import ImageNotServing, ImageService


class FakeEngine:
    backend = "fake"

    def __init__(self, fail: bool = False) -> None:
        self.loaded = False
        self.loads = 0
        self.fail = fail

    async def load(self) -> None:
        if self.fail:
            raise ImageEngineError("no such model")
        self.loads += 1
        self.loaded = True

    async def unload(self) -> None:
        self.loaded = False

    async def generate(self, job: ImageJob, seed: int, on_step: StepCallback) -> Generation:
        raise AssertionError("not used here")


class Watched:
    def __init__(self, engine: FakeEngine, idle: float = 0.0) -> None:
        self.states: asyncio.Queue[BackendState] = asyncio.Queue()
        self.engine = engine
        self.service = ImageService(
            ModelName("m"),
            engine,
            idle_unload_s=idle,
            on_state=lambda s, _d: self.states.put_nowait(s),
        )

    async def next(self) -> BackendState:
        async with asyncio.timeout(5):
            return await self.states.get()


@pytest.fixture
async def running() -> AsyncIterator[Watched]:
    watched = Watched(FakeEngine(), idle=0.3)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watched.service.run())
        yield watched
        task.cancel()


async def test_idle_unload_then_a_job_loads_it_again(running: Watched) -> None:
    assert await running.next() is BackendState.READY
    assert await running.next() is BackendState.UNLOADED  # after 0.3 s without jobs
    assert not running.engine.loaded
    async with running.service.use():
        assert running.engine.loaded
        assert running.engine.loads == 2
    assert [await running.next(), await running.next()] == [
        BackendState.LOADING,
        BackendState.READY,
    ]


async def test_unload_and_load_on_request() -> None:
    watched = Watched(FakeEngine())  # never unloads by itself
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watched.service.run())
        assert await watched.next() is BackendState.READY
        watched.service.unload()
        assert await watched.next() is BackendState.UNLOADED
        watched.service.load()
        assert [await watched.next(), await watched.next()] == [
            BackendState.LOADING,
            BackendState.READY,
        ]
        task.cancel()


async def test_a_model_that_cannot_load_fails_its_jobs() -> None:
    watched = Watched(FakeEngine(fail=True))
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(watched.service.run())
        assert await watched.next() is BackendState.FAILED
        assert watched.service.detail == "no such model"
        with pytest.raises(ImageNotServing):
            async with watched.service.use():
                pass
        task.cancel()
