"""The dashboard's residency bars in a real headless Chromium (Debian's), against a real
router process whose worker is a stand-in speaking the real protocol (several text models,
each with its own state and bytes; ``tests/standin_worker.py``): the worker's card shows
each resident model as a bar of its model budget, the total, and what it could load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from cluster import API_KEY, GPU_KEY, Cluster, Router
from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState, Endpoint, ModelInfo
from standin_worker import StandInWorker

CHROMIUM = Path("/usr/bin/chromium")
GB = 1 << 30


def model(name: str, state: BackendState, size: int, *, pinned: bool = False) -> ModelInfo:
    return ModelInfo(
        name=ModelName(name),
        endpoints=(Endpoint.CHAT,),
        state=state,
        slots=1,
        resident_bytes=size,
        pinned=pinned,
    )


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    cluster = Cluster(tmp_path, Path("unused-llama-server"), Path("unused-model"))
    try:
        yield cluster.router("--admin-key", API_KEY)
    finally:
        cluster.stop_all()


def test_a_worker_card_shows_its_resident_models_against_its_budget(router: Router) -> None:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing; install Debian's browser with "
            "apt-get install -y --no-install-recommends chromium"
        )
    models = [
        model("big", BackendState.READY, 6 * GB, pinned=True),
        model("small", BackendState.LOADING, 2 * GB),
        model("idle", BackendState.UNLOADED, 3 * GB),
    ]
    worker = StandInWorker(
        f"127.0.0.1:{router.port}", GPU_KEY, models, name="multi", budget=16 * GB
    ).start()
    try:
        router.wait_workers(1)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
            )
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(router.url + "/")
                page.fill("#key", API_KEY)
                page.click("#login-button")
                card = page.wait_for_selector('.worker[data-worker-id="multi"] .residency')
                assert card is not None
                total = card.query_selector(".residency-total")
                assert total is not None
                assert (total.text_content() or "").startswith("Models8.0 GiB used")
                widths = {}
                for row in card.query_selector_all(".resident"):
                    fill = row.query_selector(".fill")
                    assert fill is not None
                    style = fill.get_attribute("style") or ""
                    name = row.get_attribute("data-model")
                    widths[name] = float(style.removeprefix("width: ").removesuffix("%;"))
                    if name == "big":
                        assert "6.0 GiB · pinned" in (row.text_content() or "")
                    if name == "small":
                        assert "2.0 GiB · loading" in (row.text_content() or "")
                assert widths == {"big": 37.5, "small": 12.5}
                assert card.query_selector(".loadable") is not None
                assert "loadable: idle" in (card.text_content() or "")
                assert not errors, errors
            finally:
                browser.close()
    finally:
        worker.stop()
