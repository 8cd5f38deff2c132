"""The router's dashboard in a real headless Chromium (Debian's) against a real cluster.

A real router and a real worker running llama-server with the default model; Playwright
drives the page the router serves at ``/``; nothing is intercepted. The layer map shows a
real deployment of the default model split over the test worker and a second one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    ElementHandle,
    Page,
    ViewportSize,
    sync_playwright,
)

import http_calls
from cluster import API_KEY, MODEL, Cluster, Proc, Router, wait_until
from fakes.fake_pynvml import worker_env
from fakes.tool_replay import nvidia_h100_driver

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = Path(__file__).parents[1] / "artifacts" / "dashboard.png"
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}
WORKER_NAME = "dash-w1"
OPTIONAL_ENDPOINTS = ("/metrics", "/api/v1/pipeline/status")
DEPLOYMENTS_STATUS = "/api/v1/pipeline/status"
DEPLOYMENTS_DEPLOY = "/api/v1/pipeline/deploy"
DEPLOYMENTS_UNDEPLOY = "/api/v1/pipeline/undeploy"
REPLY_TIMEOUT_MS = 120_000

# Records what the user would see of the newest assistant message, once per painted frame.
FRAME_SAMPLER = """() => {
  window.__frames = [];
  const tick = () => {
    const all = document.querySelectorAll("#transcript .msg.assistant");
    const msg = all[all.length - 1];
    if (msg) {
      const text = msg.querySelector(".body").textContent;
      const last = window.__frames[window.__frames.length - 1];
      if (!last || last.text !== text || last.state !== msg.dataset.state) {
        window.__frames.push({text, state: msg.dataset.state});
      }
    }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""


@dataclass
class Live:
    router: Router
    browser: Browser

    def worker(self) -> dict[str, Any]:
        [worker] = [w for w in self.router.workers() if w["name"] == WORKER_NAME]
        return dict(worker)


@dataclass
class Watched:
    """A page plus every JavaScript error and failed request its console reported."""

    page: Page
    base: str
    problems: list[str] = field(default_factory=list)
    allowed: set[tuple[str, int]] = field(default_factory=set)

    def on_console(self, msg: ConsoleMessage) -> None:
        if msg.type != "error":
            return
        path = urlsplit(msg.location.get("url", "")).path
        status = next((s for p, s in self.allowed if p == path and f" {s} " in msg.text), None)
        if status is None:
            self.problems.append(f"console error: {msg.text} ({msg.location})")

    def sign_in(self, key: str = API_KEY) -> None:
        self.page.goto(self.base + "/")
        self.page.fill("#key", key)
        self.page.click("#login-button")


@pytest.fixture(scope="module")
def live(session_cluster: Cluster) -> Iterator[Live]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing; install Debian's browser with "
            "apt-get install -y --no-install-recommends chromium"
        )
    router = session_cluster.router("--admin-key", API_KEY)  # the dashboard signs in with it
    worker = session_cluster.worker(router, "--slots", "2", "--ctx-size", "2048", name=WORKER_NAME)
    try:
        router.wait_workers(1)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
            )
            try:
                yield Live(router, browser)
            finally:
                browser.close()
    finally:
        _stop(worker, router.proc)


def _stop(*procs: Proc) -> None:
    for proc in procs:
        proc.stop()


@pytest.fixture
def watched(live: Live) -> Iterator[Watched]:
    """A fresh browser context; the test fails if the page logs an unexpected error."""
    context = live.browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    watched = Watched(page, live.router.url)
    # Endpoints this router may not have yet answer 404; Chromium logs those as errors.
    watched.allowed.update((p, 404) for p in OPTIONAL_ENDPOINTS)
    page.on("console", watched.on_console)
    page.on("pageerror", lambda exc: watched.problems.append(f"page error: {exc}"))
    try:
        yield watched
    finally:
        context.close()
    assert not watched.problems, "\n".join(watched.problems)


def _text(handle: ElementHandle | None, selector: str) -> str:
    assert handle is not None
    inner = handle.query_selector(selector)
    assert inner is not None, f"no {selector} in {handle.inner_html()}"
    return inner.text_content() or ""


def _get(live: Live, path: str, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http_calls.get(live.router.url + path, headers=headers, timeout=10)


def test_page_and_assets_load_without_a_key_and_only_from_the_router(
    live: Live, watched: Watched
) -> None:
    page = _get(live, "/", key=None)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    script = _get(live, "/dashboard/app.js", key=None)
    assert script.status_code == 200
    assert "javascript" in script.headers["content-type"]
    assert (
        _get(live, "/dashboard/style.css", key=None).headers["content-type"].startswith("text/css")
    )
    assert _get(live, "/dashboard/nothing-here.js", key=None).status_code == 404

    requested: list[str] = []
    watched.page.on("request", lambda request: requested.append(request.url))
    watched.page.goto(live.router.url + "/")
    assert watched.page.title() == "Shoal dashboard"
    watched.page.wait_for_selector("#login-form", state="visible")
    assert watched.page.is_hidden("#app")
    foreign = [u for u in requested if not u.startswith(live.router.url + "/")]
    assert requested and not foreign, f"requests outside the router: {foreign}"


def test_a_wrong_key_shows_the_routers_401_message(live: Live, watched: Watched) -> None:
    answer = _get(live, "/api/v1/workers", key="sk-wrong")
    assert answer.status_code == 401
    message = answer.json()["error"]["message"]
    watched.allowed.add(("/api/v1/workers", 401))

    watched.sign_in("sk-wrong")

    watched.page.wait_for_selector("#login-error", state="visible")
    assert watched.page.text_content("#login-error") == message
    assert watched.page.is_hidden("#app")
    assert watched.page.evaluate("sessionStorage.length") == 0


def test_the_sign_in_asks_for_an_admin_key(live: Live, watched: Watched) -> None:
    watched.page.goto(live.router.url + "/")
    watched.page.wait_for_selector("#login-form", state="visible")
    assert watched.page.get_attribute("#key", "placeholder") == "ak-shoal-…"  # secrets.MARKERS


def test_a_router_without_keys_says_it_is_open_instead_of_asking_for_one(
    live: Live, session_cluster: Cluster, tmp_path: Path
) -> None:
    """Any string would "sign in" to a router with no keys at all: the page says it is open.
    One with inference keys but no admin key still needs a key that reads its models."""
    database = f"sqlite:///{tmp_path / 'keys.db'}"
    open_router = session_cluster.router("--database-url", database, api_key=None, gpu_key=None)
    half_open = session_cluster.router("--database-url", database, gpu_key=None)
    context = live.browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.goto(open_router.url + "/")
        page.wait_for_selector("#open-router", state="visible")
        assert "no keys are set" in (page.text_content("#open-router") or "")
        assert page.is_visible("#app") and page.is_hidden("#login")
        assert page.is_hidden("#logout")
        page.wait_for_selector("#summary-workers")

        page = context.new_page()
        watched = Watched(page, half_open.url)
        watched.sign_in("anything")
        page.wait_for_selector("#login-error", state="visible")
        assert "Incorrect API key" in (page.text_content("#login-error") or "")
        assert page.is_hidden("#app") and page.is_hidden("#open-router")
        watched.sign_in(API_KEY)  # an inference key reads the models; the control plane is open
        page.wait_for_selector("#app", state="visible")
        assert page.is_visible("#logout") and page.is_hidden("#open-router")
    finally:
        context.close()
        _stop(open_router.proc, half_open.proc)


def test_signing_in_shows_the_live_worker_and_model(live: Live, watched: Watched) -> None:
    worker = live.worker()
    watched.sign_in()

    card = watched.page.wait_for_selector(f'.worker[data-worker-id="{worker["id"]}"]')
    assert _text(card, "h3") == WORKER_NAME
    assert _text(card, ".pill") == "ready"
    facts = _text(card, ".worker-body")
    assert worker["hardware"]["hostname"] in facts
    assert MODEL in facts
    assert "RAM" in facts and "free" in facts

    row = watched.page.wait_for_selector(f'#models tr[data-model="{MODEL}"]')
    assert row is not None
    cells = [c.text_content() for c in row.query_selector_all("td")]
    assert cells[1:3] == ["ready", "1 / 1"]
    queue = watched.page.text_content(f'#queue .queue-row[data-model="{MODEL}"]') or ""
    assert "0 queued" in queue
    assert watched.page.input_value("#model") == MODEL
    assert watched.page.evaluate("sessionStorage.getItem('shoal.adminKey')") == API_KEY
    _check_optional_panels(live, watched.page)


def _check_optional_panels(live: Live, page: Page) -> None:
    """Deployments and chart show what the router really has."""
    if not _get(live, DEPLOYMENTS_STATUS).json()["data"]:
        page.wait_for_selector("#deployments >> text=No deployments")
    if _get(live, "/metrics").status_code == 404:
        page.wait_for_selector("#chart-note >> text=Metrics unavailable")
    else:  # two polls give the first rate: the legend shows numbers
        page.wait_for_function("() => document.querySelector('#now-tokens').textContent !== '–'")


def test_a_worker_card_shows_each_gpus_telemetry(
    live: Live, watched: Watched, session_cluster: Cluster
) -> None:
    """A worker whose NVML is a FAKE (no NVIDIA GPU here; ``fakes.fake_pynvml``) reporting two
    H100s: its card shows a utilization and a memory bar per GPU, temperature and power as
    text, all from what the router's worker list says."""
    router = live.router
    gpu_worker = session_cluster.worker(
        router, "--slots", "1", "--ctx-size", "1024", name="dash-gpu", env=worker_env()
    )
    try:
        entry = wait_until(
            lambda: next(
                (w for w in router.workers() if w["name"] == "dash-gpu" and w["gpu_telemetry"]),
                None,
            ),
            120,
            "the GPU worker's first heartbeat",
        )
        watched.sign_in()
        card = watched.page.wait_for_selector(f'.worker[data-worker-id="{entry["id"]}"]')
        assert card is not None
        for sample in entry["gpu_telemetry"]:
            gpu = card.query_selector(f'.gpu[data-gpu="{sample["index"]}"]')
            assert gpu is not None, card.inner_html()
            readout = _text(gpu, ".gpu-readout")
            assert readout == (
                f"{sample['temperature_celsius']:.0f} °C · "
                f"{sample['power_watts']:.0f} / {sample['power_limit_watts']:.0f} W"
            )
            assert sample["name"] in _text(gpu, ".gpu-name")
            util = gpu.query_selector(".gpu-util")
            assert util is not None
            percent = sample["utilization_percent"]
            assert _text(util, ".meter-label") == f"Utilization{percent:.0f}%"
            assert _width(util) == pytest.approx(percent, abs=0.1)
            memory = gpu.query_selector(".gpu-memory")
            assert memory is not None
            used = sample["memory_used_bytes"] / sample["memory_total_bytes"]
            assert _width(memory) == pytest.approx(100 * used, abs=0.1)
            # h100x2.json: 72790 of 81559 MiB used on each
            assert _text(memory, ".meter-label") == "Memory71 GiB used · 8.6 GiB free"
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shot = SCREENSHOT.with_name("dashboard-gpu-card.png")
        watched.page.locator(f'.worker[data-worker-id="{entry["id"]}"]').screenshot(path=shot)
    finally:
        _stop(gpu_worker)


def _width(meter: ElementHandle) -> float:
    """The fill of a meter's bar, in percent of the bar."""
    fill = meter.query_selector(".fill")
    assert fill is not None
    style = fill.get_attribute("style") or ""
    return float(style.removeprefix("width: ").removesuffix("%;"))


def test_playground_streams_a_reply_from_the_real_model(live: Live, watched: Watched) -> None:
    page = watched.page
    watched.sign_in()
    page.wait_for_selector(f'.worker >> text="{WORKER_NAME}"')
    page.wait_for_function(f"() => document.querySelector('#model').value === '{MODEL}'")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "Name three colours of the sea, one per line.")
    page.evaluate(FRAME_SAMPLER)

    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    body = json.loads(sent.value.post_data or "{}")
    assert body["stream"] is True and body["max_tokens"] == 24 and body["model"] == MODEL

    page.wait_for_selector(
        '#transcript .msg.assistant:not([data-state="streaming"])', timeout=REPLY_TIMEOUT_MS
    )
    frames: list[dict[str, str]] = page.evaluate("window.__frames")
    final = page.text_content("#transcript .msg.assistant .body") or ""
    assert page.get_attribute("#transcript .msg.assistant", "data-state") == "done", final
    streaming = [f["text"] for f in frames if f["state"] == "streaming" and f["text"]]
    assert len(set(streaming)) >= 2, f"the reply did not grow frame by frame: {frames}"
    assert all(final.startswith(text) for text in streaming), frames
    assert final.strip()
    assert "tokens" in (page.text_content("#chat-stats") or "")
    assert page.is_enabled("#send") and page.is_disabled("#stop")

    time.sleep(2.5)  # one more poll: the chart and panels show the request that just ran
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)


def _busy_slots(backend_url: str) -> int:
    slots = http_calls.get(backend_url + "/slots", timeout=2).json()
    return sum(1 for s in slots if s["is_processing"])


def test_stop_aborts_the_stream_and_the_generation(live: Live, watched: Watched) -> None:
    page = watched.page
    backend = live.worker()["backend_url"]
    watched.sign_in()
    page.wait_for_function(f"() => document.querySelector('#model').value === '{MODEL}'")
    page.fill("#max-tokens", "1500")
    page.fill("#prompt", "Write a very long story about the sea, with many chapters.")
    page.click("#send")
    page.wait_for_function(
        "() => document.querySelector('#transcript .msg.assistant .body').textContent.length > 0",
        timeout=REPLY_TIMEOUT_MS,
    )
    page.click("#stop")

    page.wait_for_selector('#transcript .msg.assistant[data-state="stopped"]')
    wait_until(lambda: _busy_slots(backend) == 0, 5, "llama-server to stop generating")
    stopped_text = page.text_content("#transcript .msg.assistant .body")
    time.sleep(0.5)
    assert page.text_content("#transcript .msg.assistant .body") == stopped_text
    assert page.is_enabled("#send")


def test_the_queue_panel_shows_the_requests_each_key_has_waiting(
    live: Live, watched: Watched
) -> None:
    """Both slots busy and one more request waiting: the panel names the key (the flag key's
    tenant here) with its one waiting request, from the router's /metrics."""
    page = watched.page
    watched.sign_in()
    page.wait_for_selector("#key-queue >> text=No key is waiting.")
    body = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Count in words."}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with ThreadPoolExecutor(3) as pool:
        answers = [
            pool.submit(
                httpx.post,
                live.router.url + "/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=REPLY_TIMEOUT_MS / 1000,
            )  # fmt: skip
            for _ in range(3)  # the worker has 2 slots: one waits
        ]
        row = page.wait_for_selector("#key-queue .queue-row", timeout=30_000)
        assert row is not None
        assert "a key given by flag" in (row.text_content() or "")
        assert "1 waiting" in (row.text_content() or "")
        assert all(a.result().status_code == 200 for a in answers)
    page.wait_for_selector("#key-queue >> text=No key is waiting.")


def test_layer_map_shows_a_real_deployment(
    live: Live, watched: Watched, session_cluster: Cluster
) -> None:
    """The default model split over the test worker and a second one, deployed for real."""
    router = live.router
    second = session_cluster.worker(router, "--slots", "1", "--ctx-size", "1024", name="dash-w2")
    try:
        [w2] = wait_until(
            lambda: [
                w for w in router.workers() if w["name"] == "dash-w2" and w["state"] == "ready"
            ],
            60,
            "the second worker",
        )
        w1 = live.worker()
        body = {
            "model": str(session_cluster.model_path),
            "name": "dash-split",
            "workers": [WORKER_NAME, "dash-w2"],
            "ctx": 1024,
        }
        r = http_calls.post(router.url + DEPLOYMENTS_DEPLOY, json=body, headers=router.headers)
        assert r.status_code == 202, r.text
        wait_until(
            lambda: _get(live, DEPLOYMENTS_STATUS).json()["data"][0]["state"] == "serving",
            120,
            "the split model to serve",
        )
        watched.sign_in()
        deployment = watched.page.wait_for_selector(
            '.deployment[data-deployment="dash-split"] .layer-map'
        )
        assert deployment is not None
        card = watched.page.query_selector('.deployment[data-deployment="dash-split"]')
        assert card is not None
        cells = card.query_selector_all(".layer-map .cell")
        owners = [c.get_attribute("data-worker") for c in cells]
        assert owners == [w1["id"]] * 15 + [w2["id"]] * 15
        colours = [c.evaluate("e => getComputedStyle(e).backgroundColor") for c in cells]
        assert len(set(colours[:15])) == 1 and len(set(colours[15:])) == 1
        assert colours[0] != colours[-1]
        legend = card.text_content() or ""
        assert "layers 0–14" in legend and "layers 15–29" in legend and "serving" in legend
        # The stage's link as the head timed it (the head loaded through it): the head reports
        # its stages' round trips within LINK_REPORT_S of serving; until then the map says "RPC –".
        link_of_stage = (
            '.deployment[data-deployment="dash-split"] '
            f'.shard-legend li[data-worker="{w2["id"]}"] .link'
        )
        watched.page.wait_for_function(
            "s => (document.querySelector(s)?.textContent || '').includes(' ms ')",
            arg=link_of_stage,
            timeout=30_000,
        )
        stage = watched.page.query_selector(link_of_stage)
        assert stage is not None
        link = stage.text_content() or ""
        assert link.startswith("RPC ") and " ms " in link and "to stage" in link, link
        assert card.query_selector(f'.shard-legend li[data-worker="{w1["id"]}"] .link') is None
    finally:
        http_calls.post(
            router.url + DEPLOYMENTS_UNDEPLOY, json={"name": "dash-split"}, headers=router.headers
        )
        _stop(second)


def test_a_gpu_worker_on_a_cpu_build_is_never_silent(
    live: Live, watched: Watched, session_cluster: Cluster, tmp_path: Path
) -> None:
    """A worker that finds GPUs (a FAKE nvidia-smi replaying a recorded H100 machine first on
    its PATH, ``fakes.tool_replay``; NVML cannot load here, so detection falls back to it) but
    runs the CPU build of llama-server warns at start with the fix, registers why its GPUs sit
    idle, and its card shows a badge; the card of a worker without GPUs shows none."""
    driver = nvidia_h100_driver().on_path(tmp_path / "driver")
    path = f"{driver}{os.pathsep}{os.environ['PATH']}"
    gpu = session_cluster.worker(
        live.router, "--slots", "1", "--ctx-size", "1024", name="dash-gpu", env={"PATH": path}
    )
    try:
        [worker] = wait_until(
            lambda: [
                w
                for w in live.router.workers()
                if w["name"] == "dash-gpu" and w["state"] == "ready"
            ],
            60,
            "the worker with the fake driver",
        )
        unused = worker["gpus_unused"]
        assert {g["name"] for g in worker["hardware"]["gpus"]} == {"NVIDIA H100 80GB HBM3"}
        assert "drives none of them" in unused and "--llama-server-path" in unused
        assert live.worker()["gpus_unused"] is None
        warnings = [line for line in gpu.log().splitlines() if "WARNING" in line]
        assert any("drives none of them" in line for line in warnings), gpu.log()[-3000:]

        watched.sign_in()
        card = watched.page.wait_for_selector(f'.worker[data-worker-id="{worker["id"]}"]')
        assert card is not None
        badge = card.query_selector(".card-head .gpus-unused")
        assert badge is not None and badge.text_content() == "GPUs unused"
        assert badge.get_attribute("title") == unused
        assert _text(card, ".gpus-unused-why") == unused
        assert _text(card, ".pill") == "ready"
        other = watched.page.query_selector(f'.worker[data-worker-id="{live.worker()["id"]}"]')
        assert other is not None and other.query_selector(".gpus-unused") is None
    finally:
        _stop(gpu)
