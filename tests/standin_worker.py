"""A stand-in worker for router tests through real router processes: it speaks the real
protocol over the real WebSocket (``Register``, heartbeats, job frames) but runs no
llama-server. It serves text models that report their own state (several per worker,
protocol 17), answers ``ModelControl`` by changing a model's state, and answers each job:

* a job of a model not resident here first sends ``JobLoading`` and waits ``load_s`` (the
  model is then resident, as a worker that loaded it);
* a prompt containing ``FAIL`` is then failed (``JobFailed``, 503, nothing sent);
* else a stream gets two chunks (``Hello``, `` there``) and ``JobDone``; a non-streamed job
  one ``JobResult``.

It runs its own event loop in a thread (``start``/``stop``), so sync tests drive it beside
the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

import orjson
import websockets
from websockets.asyncio.client import ClientConnection

from shoal.protocol.ids import ModelName, WorkerId
from shoal.protocol.messages import (
    PROTOCOL_VERSION,
    WS_PATH,
    BackendState,
    Chunk,
    Chunks,
    ErrorBody,
    Hardware,
    Heartbeat,
    JobDone,
    JobFailed,
    JobLoading,
    JobResult,
    JobStart,
    ModelControl,
    ModelInfo,
    ModelsChanged,
    Register,
    Registered,
    decode_router_message,
    encode,
)

RAM_BYTES = 16 * 2**30


def chunk(text: str) -> str:
    return orjson.dumps(
        {
            "id": "chatcmpl-standin",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "standin",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
    ).decode()


def result(model: str) -> str:
    return orjson.dumps(
        {
            "id": "chatcmpl-standin",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello there"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    ).decode()


class StandInWorker:
    """One stand-in worker connected to ``router`` (``host:port``) while started."""

    def __init__(
        self,
        router: str,
        key: str,
        models: Sequence[ModelInfo],
        *,
        name: str = "standin",
        budget: int | None = None,
        slots: int = 2,
        load_s: float = 0.5,
    ) -> None:
        self.url = f"ws://{router}{WS_PATH}"
        self.key = key
        self.name = name
        self.models = {m.name: m for m in models}
        self.budget = budget
        self.slots = slots
        self.load_s = load_s
        self.controls: list[ModelControl] = []
        self.started_jobs: list[JobStart] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._registered = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 10.0) -> StandInWorker:
        self._thread.start()
        if not self._registered.wait(timeout):
            raise AssertionError(f"stand-in {self.name} did not register: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._session())
        except BaseException as exc:  # reported by start() or the test's assertions
            self._error = exc
        finally:
            self._loop.close()

    def register(self) -> Register:
        return Register(
            protocol_version=PROTOCOL_VERSION,
            worker_id=WorkerId(self.name),
            name=self.name,
            hardware=Hardware(
                hostname=self.name,
                os="Linux",
                cpu_count=4,
                ram_total_bytes=RAM_BYTES,
                ram_available_bytes=RAM_BYTES // 2,
            ),
            models=tuple(self.models.values()),
            slots=self.slots,
            state=BackendState.READY,
            model_budget_bytes=self.budget,
            software="standin",
        )

    async def _session(self) -> None:
        self._stop = asyncio.Event()
        headers = {"Authorization": f"Bearer {self.key}"}
        async with await websockets.connect(self.url, additional_headers=headers) as ws:
            await ws.send(encode(self.register()))
            reply = decode_router_message(await ws.recv())
            assert isinstance(reply, Registered), reply
            self._registered.set()
            async with asyncio.TaskGroup() as tg:
                beats = tg.create_task(self._beat(ws, reply.heartbeat_interval_s))
                reader = tg.create_task(self._read(ws, tg))
                await self._stop.wait()
                beats.cancel()
                reader.cancel()

    async def _beat(self, ws: ClientConnection, interval: float) -> None:
        beat = encode(
            Heartbeat(state=BackendState.READY, running_jobs=0, ram_available_bytes=RAM_BYTES)
        )
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await ws.send(beat)
                await asyncio.sleep(interval)

    async def _read(self, ws: ClientConnection, tg: asyncio.TaskGroup) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in ws:
                msg = decode_router_message(frame)
                if isinstance(msg, JobStart):
                    self.started_jobs.append(msg)
                    tg.create_task(self._answer(ws, msg))
                elif isinstance(msg, ModelControl):
                    self.controls.append(msg)
                    state = BackendState.READY if msg.action == "load" else BackendState.UNLOADED
                    await self._set_state(ws, msg.model, state)

    async def _set_state(self, ws: ClientConnection, model: ModelName, state: BackendState) -> None:
        info = self.models[model]
        loads = info.loads + (state is BackendState.READY and info.state is not state)
        self.models[model] = info.model_copy(
            update={"state": state, "loads": loads, "load_seconds": self.load_s}
        )
        await ws.send(encode(ModelsChanged(models=tuple(self.models.values()))))

    async def _answer(self, ws: ClientConnection, job: JobStart) -> None:
        if self.models[job.model].state is not BackendState.READY:
            await ws.send(encode(JobLoading(job_id=job.job_id, model=job.model)))
            await asyncio.sleep(self.load_s)
            await self._set_state(ws, job.model, BackendState.READY)
        if "FAIL" in orjson.dumps(job.body).decode():
            error = ErrorBody(message="the stand-in failed it", type="server_error")
            await ws.send(encode(JobFailed(job_id=job.job_id, status=503, error=error)))
            return
        if not job.stream:
            await ws.send(encode(JobResult(job_id=job.job_id, body=result(job.model))))
            return
        for i, text in enumerate(("Hello", " there")):
            item = Chunk(job_id=job.job_id, data=chunk(text), tokens=(i + 1,))
            await ws.send(encode(Chunks(items=(item,))))
        await ws.send(encode(JobDone(job_id=job.job_id)))
