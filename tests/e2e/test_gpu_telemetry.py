"""GPU telemetry through a real router and a real worker (with its real llama-server).

No machine here has an NVIDIA GPU, so the worker's NVML is a FAKE (``fakes.fake_pynvml``, on
the worker's ``PYTHONPATH``) answering for two H100s with values transcribed from a recorded
``nvidia-smi``; everything else is real: detection finds the GPUs through it, the worker
samples them off its event loop at each heartbeat, the router keeps the latest and shows
them in ``/metrics`` and ``GET /api/v1/workers``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import http_calls
from cluster import MODEL, Cluster, Router, wait_until
from fakes.fake_pynvml import machine_gpus, worker_env

pytestmark = pytest.mark.e2e

MIB = 1 << 20
WORKER = "gpu-w"


def scrape(router: Router) -> list[Sample]:
    r = http_calls.get(router.url + "/metrics", headers=router.headers, timeout=5)
    r.raise_for_status()
    return [s for family in text_string_to_metric_families(r.text) for s in family.samples]


def gpu_series(router: Router) -> dict[tuple[str, str, str], float]:
    """``(gauge, worker, gpu) -> value`` of the router's ``shoal_gpu_*`` samples."""
    return {
        (s.name, s.labels["worker"], s.labels["gpu"]): s.value
        for s in scrape(router)
        if s.name.startswith("shoal_gpu_")
    }


def gpu_info(router: Router) -> list[dict[str, str]]:
    return [s.labels for s in scrape(router) if s.name == "shoal_gpu_info"]


def expected_series(worker: str) -> dict[tuple[str, str, str], float]:
    series: dict[tuple[str, str, str], float] = {}
    for index, gpu in enumerate(machine_gpus()):
        at = (worker, str(index))
        series |= {
            ("shoal_gpu_utilization_ratio", *at): gpu["utilization_percent"] / 100,
            ("shoal_gpu_memory_used_bytes", *at): gpu["memory_used_mib"] * MIB,
            ("shoal_gpu_memory_total_bytes", *at): gpu["memory_total_mib"] * MIB,
            ("shoal_gpu_temperature_celsius", *at): gpu["temperature_celsius"],
            ("shoal_gpu_power_watts", *at): gpu["power_watts"],
            ("shoal_gpu_power_limit_watts", *at): gpu["power_limit_watts"],
            ("shoal_gpu_info", *at): 1,
        }
    return series


def listed(router: Router, name: str) -> dict[str, Any] | None:
    found = [w for w in router.workers() if w["name"] == name and w["gpu_telemetry"]]
    return found[0] if found else None


def test_gpu_gauges_and_worker_list_through_a_real_router_and_worker(cluster: Cluster) -> None:
    router = cluster.router()
    plain = cluster.worker(router, name="cpu-w")  # no GPU: no telemetry, no series
    worker = cluster.worker(router, name=WORKER, env=worker_env())
    router.wait_workers(2)
    entry = wait_until(lambda: listed(router, WORKER), 30, "the worker's first GPU heartbeat")
    gpus = machine_gpus()
    assert [g["name"] for g in entry["hardware"]["gpus"]] == [g["name"] for g in gpus]
    assert entry["hardware"]["accelerator"] == "cuda"  # detected through the same NVML
    assert entry["gpu_telemetry"] == [
        {
            "index": index,
            "uuid": gpu["uuid"],
            "name": gpu["name"],
            "utilization_percent": gpu["utilization_percent"],
            "memory_used_bytes": gpu["memory_used_mib"] * MIB,
            "memory_total_bytes": gpu["memory_total_mib"] * MIB,
            "temperature_celsius": gpu["temperature_celsius"],
            "power_watts": gpu["power_watts"],
            "power_limit_watts": gpu["power_limit_watts"],
        }
        for index, gpu in enumerate(gpus)
    ]
    free = [(g["memory_total_mib"] - g["memory_used_mib"]) * MIB for g in gpus]
    assert entry["gpu_free_bytes"] == free  # the same reading, not a second one
    [cpu_entry] = [w for w in router.workers() if w["name"] == "cpu-w"]
    assert cpu_entry["gpu_telemetry"] == []

    assert gpu_series(router) == expected_series(WORKER)
    assert gpu_info(router) == [
        {"worker": WORKER, "gpu": str(index), "name": gpu["name"], "uuid": gpu["uuid"]}
        for index, gpu in enumerate(gpus)
    ]

    worker.stop()
    wait_until(lambda: not gpu_series(router), 30, "the stopped worker's series to go")
    assert plain.alive()


def test_every_router_on_redis_lists_the_gpus_and_gauges_its_own(
    cluster: Cluster, redis_prefix: str
) -> None:
    """With Redis the telemetry rides the worker list: the other router lists the worker's
    GPUs too; the gauges are each router's own workers' (as ``shoal_workers``)."""
    url = "redis://127.0.0.1:6379/0"
    a = cluster.router("--redis-url", url, "--redis-prefix", redis_prefix)
    b = cluster.router("--redis-url", url, "--redis-prefix", redis_prefix)
    cluster.worker(a, name=WORKER, env=worker_env())
    on_a = wait_until(lambda: listed(a, WORKER), 60, "the worker's first GPU heartbeat on A")
    on_b = wait_until(lambda: listed(b, WORKER), 30, "router B to list the worker's GPUs")
    assert on_b["gpu_telemetry"] == on_a["gpu_telemetry"]
    assert (on_b["id"], on_b["router"]) == (on_a["id"], on_a["router"])  # held by A
    assert gpu_series(a) == expected_series(WORKER)
    assert gpu_series(b) == {}


def beat_seen(router: Router, name: str) -> None:
    """Wait until the router has a heartbeat from ``name`` newer than now."""
    [before] = [w for w in router.workers() if w["name"] == name]
    since = time.monotonic()

    def newer() -> bool:
        [entry] = [w for w in router.workers() if w["name"] == name]
        waited = time.monotonic() - since
        return bool(entry["last_seen_s_ago"] + 0.2 < before["last_seen_s_ago"] + waited)

    wait_until(newer, 30, f"a heartbeat from {name}")


def test_a_worker_told_to_use_no_gpu_computes_on_the_cpu_and_reports_none(
    cluster: Cluster,
) -> None:
    """``--gpu-devices none`` on a GPU machine (a CPU stage beside a GPU worker, say): the
    worker still describes its machine's GPUs, but samples none, says none sits idle (it was
    told), and serves on the CPU."""
    router = cluster.router()
    worker = cluster.worker(router, "--gpu-devices", "none", name="cpu-only", env=worker_env())
    [entry] = router.wait_workers(1)
    beat_seen(router, "cpu-only")
    [entry] = router.workers()
    assert [g["name"] for g in entry["hardware"]["gpus"]] == [g["name"] for g in machine_gpus()]
    assert entry["gpu_telemetry"] == [] and entry["gpus_unused"] is None
    assert gpu_series(router) == {}
    r = http_calls.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers=router.headers,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    assert "--device none" in worker.log()
