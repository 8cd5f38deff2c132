"""The ``shoal_gpu_*`` gauges: each GPU of this router's workers, as its last heartbeat said.

Built at scrape time from the samples the workers' connections keep (``Snapshot.gpus``):
nothing is done per heartbeat, and a worker that leaves takes its series with it. Every gauge
is labelled ``worker`` (its ``--name``; its id when connected workers share the name, so no
two series collide) and ``gpu`` (the vendor tool's index, as ``--gpu-devices`` counts). A
reading the GPU's tool cannot give has no series, rather than a made-up 0.

With Redis each router exposes its own workers' GPUs, as ``shoal_workers`` counts its own:
scrape every router. (``GET /api/v1/workers`` lists every router's, telemetry included.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from shoal.protocol.telemetry import GpuSample

LABELS = ("worker", "gpu")


def _ratio(sample: GpuSample) -> float | None:
    percent = sample.utilization_percent
    return None if percent is None else percent / 100


_GAUGES: tuple[tuple[str, str, Callable[[GpuSample], float | int | None]], ...] = (
    (
        "shoal_gpu_utilization_ratio",
        "How busy each GPU's compute engine was when its worker last reported, 0-1 (NVML's GPU "
        "utilization, amd-smi's gfx activity).",
        _ratio,
    ),
    (
        "shoal_gpu_memory_used_bytes",
        "Memory in use on each GPU (by any process).",
        lambda s: s.memory_used_bytes,
    ),
    (
        "shoal_gpu_memory_total_bytes",
        "Memory of each GPU.",
        lambda s: s.memory_total_bytes,
    ),
    (
        "shoal_gpu_temperature_celsius",
        "Temperature of each GPU's die (AMD: edge sensor, else hotspot).",
        lambda s: s.temperature_celsius,
    ),
    (
        "shoal_gpu_power_watts",
        "Power each GPU draws.",
        lambda s: s.power_watts,
    ),
    (
        "shoal_gpu_power_limit_watts",
        "The power cap each GPU is held to.",
        lambda s: s.power_limit_watts,
    ),
)


def worker_labels(workers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``worker`` label per worker id, from ``(id, name)`` pairs: its name, or its id when
    several of them share the name (their series would collide)."""
    pairs = list(workers)
    names = Counter(name for _, name in pairs)
    return {worker_id: name if names[name] == 1 else worker_id for worker_id, name in pairs}


def gpu_families(gpus: Mapping[str, Sequence[GpuSample]]) -> Iterator[Metric]:
    """The ``shoal_gpu_*`` families for ``worker label -> its GPUs' samples``; each family is
    there (with no series) when no worker reports a GPU."""
    rows = [(worker, sample) for worker, samples in sorted(gpus.items()) for sample in samples]
    for name, documentation, read in _GAUGES:
        family = GaugeMetricFamily(name, documentation, labels=LABELS)
        for worker, sample in rows:
            value = read(sample)
            if value is not None:
                family.add_metric([worker, str(sample.index)], value)
        yield family
    info = GaugeMetricFamily(
        "shoal_gpu_info",
        "1 for each GPU of this router's workers, labelled with its model name and UUID.",
        labels=(*LABELS, "name", "uuid"),
    )
    for worker, sample in rows:
        info.add_metric([worker, str(sample.index), sample.name, sample.uuid], 1)
    yield info
