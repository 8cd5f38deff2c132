"""The ``shoal_gpu_*`` gauges from a ``Snapshot`` (``gpu_metrics``) and their ``worker``
label. ``test_cluster_view.py`` checks them through a router's app fed real heartbeats."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shoal.protocol.telemetry import GpuSample
from shoal.router.observe.gpu_metrics import worker_labels
from shoal.router.observe.metrics import Metrics, Snapshot

MIB = 1 << 20
GAUGES = (
    "shoal_gpu_utilization_ratio",
    "shoal_gpu_memory_used_bytes",
    "shoal_gpu_memory_total_bytes",
    "shoal_gpu_temperature_celsius",
    "shoal_gpu_power_watts",
    "shoal_gpu_power_limit_watts",
    "shoal_gpu_info",
)
H100 = GpuSample(
    index=0,
    uuid="GPU-0",
    name="NVIDIA H100 80GB HBM3",
    utilization_percent=37,
    memory_used_bytes=72790 * MIB,
    memory_total_bytes=81559 * MIB,
    temperature_celsius=39,
    power_watts=145.5,
    power_limit_watts=700,
)


def scrape(metrics: Metrics) -> list[Sample]:
    body = metrics.render()[0].decode()
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def gpu_series(samples: list[Sample]) -> dict[tuple[str, str, str], float]:
    """``(gauge, worker, gpu) -> value`` of the ``shoal_gpu_*`` samples."""
    return {
        (s.name, s.labels["worker"], s.labels["gpu"]): s.value
        for s in samples
        if s.name.startswith("shoal_gpu_")
    }


@pytest.mark.parametrize(
    ("workers", "labels"),
    [
        ([], {}),
        ([("a-1", "a"), ("b-1", "b")], {"a-1": "a", "b-1": "b"}),
        ([("a-1", "a"), ("a-2", "a"), ("b-1", "b")], {"a-1": "a-1", "a-2": "a-2", "b-1": "b"}),
    ],
)
def test_the_worker_label_is_its_name_unless_names_collide(
    workers: list[tuple[str, str]], labels: dict[str, str]
) -> None:
    assert worker_labels(workers) == labels


def test_each_reading_is_a_gauge_labelled_by_worker_and_gpu() -> None:
    partial = GpuSample(index=1, name="NVIDIA GB10", utilization_percent=0, temperature_celsius=41)
    m = Metrics(lambda: Snapshot(gpus={"w1": (H100, partial)}))
    samples = scrape(m)
    assert gpu_series(samples) == {
        ("shoal_gpu_utilization_ratio", "w1", "0"): 0.37,
        ("shoal_gpu_memory_used_bytes", "w1", "0"): 72790 * MIB,
        ("shoal_gpu_memory_total_bytes", "w1", "0"): 81559 * MIB,
        ("shoal_gpu_temperature_celsius", "w1", "0"): 39,
        ("shoal_gpu_power_watts", "w1", "0"): 145.5,
        ("shoal_gpu_power_limit_watts", "w1", "0"): 700,
        ("shoal_gpu_info", "w1", "0"): 1,
        # GPU 1 knows no memory or power: no series for those, rather than a made-up 0
        ("shoal_gpu_utilization_ratio", "w1", "1"): 0,
        ("shoal_gpu_temperature_celsius", "w1", "1"): 41,
        ("shoal_gpu_info", "w1", "1"): 1,
    }
    info = [s.labels for s in samples if s.name == "shoal_gpu_info"]
    assert info == [
        {"worker": "w1", "gpu": "0", "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0"},
        {"worker": "w1", "gpu": "1", "name": "NVIDIA GB10", "uuid": ""},
    ]


def test_without_gpus_the_families_are_there_with_no_series() -> None:
    body = Metrics(Snapshot).render()[0].decode()
    for gauge in GAUGES:
        assert f"# TYPE {gauge} gauge" in body
    assert gpu_series(scrape(Metrics(Snapshot))) == {}
