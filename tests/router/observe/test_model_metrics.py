"""The ``shoal_model_*`` series (``model_metrics``): scraped from ``/metrics`` of a router app
whose workers (real connections, no sockets) report several text models each.
``tests/router/routes/test_loading_stream.py`` scrapes a real router process too."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from shoal.router.app import build_app
from shoal.router.settings import RouterSettings
from socketless import worker_connection

GB = 1 << 30


def text(name: str, state: BackendState | None, **figures: object) -> ModelInfo:
    return ModelInfo(name=ModelName(name), endpoints=(Endpoint.CHAT,), state=state, **figures)


async def test_metrics_name_each_models_loads_evictions_load_time_and_bytes(
    tmp_path: Path,
) -> None:
    app = build_app(RouterSettings(database_url=f"sqlite:///{tmp_path}/keys.db"))
    several = worker_connection(
        "several",
        [
            text(
                "a", BackendState.READY, slots=3, resident_bytes=3 * GB, load_seconds=4.5, loads=2
            ),
            text("b", BackendState.UNLOADED, resident_bytes=2 * GB, loads=1, evictions=1),
        ],
        model_budget_bytes=4 * GB,
    )
    single = worker_connection("single", [text("c", None)])
    for w in (several, single):
        app.ctx.dispatcher.workers.on_registered(w)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://r"
    ) as client:
        try:
            body = (await client.get("/metrics")).text
        finally:
            await app.ctx.accounting.limiter.close()
            if app.ctx.store is not None:
                app.ctx.store.close()
    samples = [s for family in text_string_to_metric_families(body) for s in family.samples]
    free = {s.labels["model"]: s.value for s in samples if s.name == "shoal_ready_slots"}
    assert free == {"a": 3, "b": 1, "c": 1}  # a's own three slots; b and c the worker's one
    series = {
        (s.name, s.labels["model"], s.labels["worker"]): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name.startswith("shoal_model_")
    }
    assert series == {
        ("shoal_model_loads_total", "a", "several"): 2,
        ("shoal_model_loads_total", "b", "several"): 1,
        ("shoal_model_evictions_total", "a", "several"): 0,
        ("shoal_model_evictions_total", "b", "several"): 1,
        ("shoal_model_load_seconds", "a", "several"): 4.5,
        ("shoal_model_resident_bytes", "a", "several"): 3 * GB,
        ("shoal_model_resident_bytes", "b", "several"): 0,
    }
