"""POST /api/v1/models/load|unload against an in-process router app: real registry and worker
connections without sockets (the order sent is read from the worker's outbox)."""

from __future__ import annotations

from pathlib import Path

import httpx

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import (
    BackendState,
    Endpoint,
    ModelControl,
    ModelInfo,
    decode_router_message,
)
from shoal.router.app import build_app
from shoal.router.dispatch.workers import WorkerConnection
from shoal.router.settings import RouterSettings
from socketless import worker_connection

TEXT = ModelInfo(name=ModelName("smol"), endpoints=(Endpoint.CHAT,))
IMAGE = ModelInfo(
    name=ModelName("tiny-sd"),
    endpoints=(Endpoint.IMAGE_GENERATIONS,),
    backend="diffusers",
    state=BackendState.UNLOADED,
)


async def test_load_and_unload_reach_the_workers_of_image_models(tmp_path: Path) -> None:
    app = build_app(RouterSettings(database_url=f"sqlite:///{tmp_path}/keys.db"))
    worker = worker_connection("box", [TEXT, IMAGE], worker_id="w1")
    app.ctx.dispatcher.workers.on_registered(worker)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://r"
    ) as client:
        try:
            r = await client.post("/api/v1/models/load", json={"model": "tiny-sd"})
            assert r.status_code == 202, r.text
            assert r.json()["workers"] == [
                {"worker": "w1", "worker_name": "box", "was": "unloaded"}
            ]
            sent = decode_router_message(worker.outbox.get_nowait())
            assert sent == ModelControl(model=ModelName("tiny-sd"), action="load")
            r = await client.post(
                "/api/v1/models/unload", json={"model": "tiny-sd", "worker": "box"}
            )
            assert r.status_code == 202
            unload = decode_router_message(worker.outbox.get_nowait())
            assert isinstance(unload, ModelControl) and unload.action == "unload"
            r = await client.post("/api/v1/models/load", json={"model": "smol"})
            assert r.status_code == 400 and "only models that load" in r.json()["error"]["message"]
            r = await client.post("/api/v1/models/load", json={"model": "tiny-sd", "worker": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "worker"
            assert "connected: box (w1)" in r.json()["error"]["message"]
            r = await client.post("/api/v1/models/load", json={"model": "nothing", "worker": "w1"})
            assert r.status_code == 404 and "as 'w1'" in r.json()["error"]["message"]
            twin = worker_connection("box", [IMAGE], worker_id="w2")
            app.ctx.dispatcher.workers.on_registered(twin)
            r = await client.post("/api/v1/models/load", json={"model": "tiny-sd", "worker": "box"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "worker"
            assert "named 'box': w1, w2; name the one you mean by its id" in r.text
            r = await client.post("/api/v1/models/load", json={"model": "tiny-sd", "worker": "w2"})
            assert [w["worker"] for w in r.json()["workers"]] == ["w2"]
            assert isinstance(decode_router_message(twin.outbox.get_nowait()), ModelControl)
            models = (await client.get("/v1/models")).json()["data"]
            assert {m["id"]: m["state"] for m in models} == {"smol": "ready", "tiny-sd": "unloaded"}
            assert worker.outbox.empty()
        finally:
            await app.ctx.accounting.limiter.close()
            if app.ctx.store is not None:
                app.ctx.store.close()


GB = 1 << 30


def text_model(name: str, state: BackendState, *, pinned: bool = False) -> ModelInfo:
    """A text model of a worker serving several, 4 GiB when resident."""
    return ModelInfo(
        name=ModelName(name),
        endpoints=(Endpoint.CHAT,),
        state=state,
        slots=2,
        resident_bytes=4 * GB,
        load_seconds=2.5 if state is BackendState.READY else None,
        pinned=pinned,
        loads=1 if state is BackendState.READY else 0,
    )


def controls(worker: WorkerConnection) -> list[ModelControl]:
    sent = []
    while not worker.outbox.empty():
        msg = decode_router_message(worker.outbox.get_nowait())
        if isinstance(msg, ModelControl):
            sent.append(msg)
    return sent


async def test_text_models_load_where_a_job_would_and_unload_where_loaded(tmp_path: Path) -> None:
    """Two workers, each with room for one 4 GiB model of two: a load goes where it fits
    without an eviction; one named evicts; one that cannot is a 409 saying why."""
    app = build_app(RouterSettings(database_url=f"sqlite:///{tmp_path}/keys.db"))
    full = worker_connection(
        "full",
        [text_model("a", BackendState.UNLOADED), text_model("b", BackendState.READY)],
        model_budget_bytes=6 * GB,
    )
    empty = worker_connection(
        "empty",
        [text_model("a", BackendState.UNLOADED), text_model("b", BackendState.UNLOADED)],
        model_budget_bytes=6 * GB,
    )
    for w in (full, empty):
        app.ctx.dispatcher.workers.on_registered(w)
        controls(w)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://r"
    ) as client:
        try:
            r = await client.post("/api/v1/models/load", json={"model": "a"})
            assert r.status_code == 202, r.text
            assert r.json()["workers"] == [
                {"worker": "empty", "worker_name": "empty", "was": "unloaded", "evicts": []}
            ]
            assert controls(empty) == [ModelControl(model=ModelName("a"), action="load")]
            assert controls(full) == []
            r = await client.post("/api/v1/models/load", json={"model": "a", "worker": "full"})
            assert r.status_code == 202 and r.json()["workers"][0]["evicts"] == ["b"]
            assert controls(full) == [ModelControl(model=ModelName("a"), action="load")]
            full.set_models(
                (text_model("a", BackendState.UNLOADED),)
                + (text_model("b", BackendState.READY, pinned=True),)
            )
            r = await client.post("/api/v1/models/load", json={"model": "a", "worker": "full"})
            assert r.status_code == 409, r.text
            assert "does not fit beside the pinned model(s) b" in r.json()["error"]["message"]
            assert controls(full) == []
            r = await client.post("/api/v1/models/unload", json={"model": "a"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "not_loaded"
            r = await client.post("/api/v1/models/unload", json={"model": "b"})
            assert r.status_code == 202 and [w["worker"] for w in r.json()["workers"]] == ["full"]
            assert controls(full) == [ModelControl(model=ModelName("b"), action="unload")]
            r = await client.post("/api/v1/models/load", json={"model": "zzz"})
            assert r.status_code == 404

            models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
            assert models["b"]["state"] == "ready"
            assert models["b"]["residency"] == {"loadable": 1, "resident": 1}
            assert models["b"]["resident_bytes"] == 4 * GB
            assert models["b"]["load_seconds"] == 2.5
            assert models["a"]["residency"] == {"loadable": 2}
            assert models["a"]["load_seconds"] is None
            one = (await client.get("/v1/models/b")).json()
            assert [(p["worker"], p["residency"], p["pinned"]) for p in one["placements"]] == [
                ("empty", "loadable", False),
                ("full", "resident", True),
            ]
        finally:
            await app.ctx.accounting.limiter.close()
            if app.ctx.store is not None:
                app.ctx.store.close()
