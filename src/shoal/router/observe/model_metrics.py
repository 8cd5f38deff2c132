"""The ``shoal_model_*`` series: each text model's residency on this router's workers, as
they last reported it (``ModelInfo``: loads, evictions, last load time, resident bytes).

Built at scrape time from the workers' model lists (``Snapshot.models``), like the GPU
gauges: nothing is counted per load here, the workers count (since each started), and a
worker that leaves takes its series with it. Every series is labelled ``model`` and
``worker`` (``gpu_metrics.worker_labels``). Only models that report a state of their own
or any of these figures have series (a single-model worker's model has none).

With Redis each router exposes its own workers' models: scrape every router.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from shoal.protocol.messages import BackendState, ModelInfo

LABELS = ("model", "worker")


@dataclass(frozen=True, slots=True)
class ModelSample:
    """One model on one worker, as the worker last reported it."""

    loads: int
    evictions: int
    load_seconds: float | None
    resident_bytes: int
    """What it holds now: its resident bytes while loaded or loading, else 0."""


def sample_of(info: ModelInfo) -> ModelSample | None:
    """``info``'s sample; None for a model that reports none of it."""
    if info.state is None and info.resident_bytes is None and info.load_seconds is None:
        return None
    if any(e.is_image for e in info.endpoints) and info.resident_bytes is None:
        return None  # an image model: it reports no residency figures
    holds = info.state in (BackendState.READY, BackendState.LOADING, BackendState.RESTARTING)
    return ModelSample(
        info.loads,
        info.evictions,
        info.load_seconds,
        (info.resident_bytes or 0) if holds else 0,
    )


def model_families(models: Mapping[tuple[str, str], ModelSample]) -> Iterator[Metric]:
    """The ``shoal_model_*`` families for ``(model, worker label) -> sample``; each family is
    there (with no series) when no worker reports one."""
    rows = sorted(models.items())
    loads = CounterMetricFamily(
        "shoal_model_loads",
        "Times each model was loaded on each worker since that worker started.",
        labels=LABELS,
    )
    evictions = CounterMetricFamily(
        "shoal_model_evictions",
        "Times each model was unloaded on each worker to make room for another.",
        labels=LABELS,
    )
    seconds = GaugeMetricFamily(
        "shoal_model_load_seconds",
        "How long each model's last load on each worker took, start to ready.",
        labels=LABELS,
    )
    resident = GaugeMetricFamily(
        "shoal_model_resident_bytes",
        "Memory each model holds on each worker now (RAM and VRAM; 0 when not loaded).",
        labels=LABELS,
    )
    for (model, worker), sample in rows:
        loads.add_metric([model, worker], sample.loads)
        evictions.add_metric([model, worker], sample.evictions)
        if sample.load_seconds is not None:
            seconds.add_metric([model, worker], sample.load_seconds)
        resident.add_metric([model, worker], sample.resident_bytes)
    yield from (loads, evictions, seconds, resident)
