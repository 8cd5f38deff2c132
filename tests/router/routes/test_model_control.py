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
