"""What an autoscaler needs per model, over the whole cluster: the scaling signals.

Per model: the requests waiting (``queue_depth``), how long the oldest of them has waited
(``oldest_wait_s``), the free slots of workers that take jobs (``ready_slots``: a worker
draining, loading or failed has none) and the slots answering now (``busy_slots``). With
Redis they are the cluster's on every router (every router's workers from the worker
directory, the queue from one script call per heartbeat interval), so any router answers
for all: an autoscaler reads one (take the max over routers, never the sum). Without Redis,
this router's.

``signals`` is the pure rule; ``router/routes/snapshot.py`` gathers its inputs at scrape time for
``/metrics`` (the ``shoal_cluster_*`` gauges) and for ``GET /api/v1/autoscaling``.
A worker serving several models counts its slots (and its running jobs) for each of them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from shoal.protocol.ids import ModelName


@dataclass(frozen=True, slots=True)
class WorkerSlots:
    """One worker, as the signals see it."""

    models: tuple[ModelName, ...]
    slots: int
    running: int
    takes_jobs: bool
    """Connected, its backend ready (or unloaded: it loads on the next job), not draining."""
    draining: bool = False


@dataclass(frozen=True, slots=True)
class ModelSignals:
    queue_depth: int = 0
    oldest_wait_s: float = 0.0
    ready_slots: int = 0
    busy_slots: int = 0
    workers: int = 0
    draining_workers: int = 0

    def as_json(self) -> dict[str, float | int]:
        return asdict(self)


def signals(
    workers: Iterable[WorkerSlots],
    depths: Mapping[ModelName, int],
    oldest: Mapping[ModelName, float],
) -> dict[ModelName, ModelSignals]:
    """Every model served or waited for -> its signals (``oldest``: seconds, per model; a
    model with nothing waiting has no oldest wait, whatever a stale snapshot says)."""
    slots: dict[ModelName, Counter[str]] = defaultdict(Counter)
    for w in workers:
        free = max(w.slots - w.running, 0) if w.takes_jobs else 0
        for model in w.models:
            slots[model].update(ready=free, busy=w.running, workers=1, draining=int(w.draining))
    result: dict[ModelName, ModelSignals] = {}
    for model in sorted({*slots, *depths, *oldest}):
        waiting, tally = depths.get(model, 0), slots.get(model, Counter())
        result[model] = ModelSignals(
            queue_depth=waiting,
            oldest_wait_s=round(max(oldest.get(model, 0.0), 0.0), 3) if waiting else 0.0,
            ready_slots=tally["ready"],
            busy_slots=tally["busy"],
            workers=tally["workers"],
            draining_workers=tally["draining"],
        )
    return result


_GAUGES = (
    ("queue_depth", "shoal_cluster_queue_depth", "Requests waiting for a worker"),
    (
        "oldest_wait_s",
        "shoal_cluster_oldest_wait_seconds",
        "How long the oldest waiting request has waited",
    ),
    ("ready_slots", "shoal_cluster_ready_slots", "Free slots on workers that take jobs"),
    ("busy_slots", "shoal_cluster_busy_slots", "Slots answering a request now"),
)


def families(per_model: Mapping[ModelName, ModelSignals]) -> Iterator[Metric]:
    """The ``shoal_cluster_*`` gauges, one series per model."""
    for field, name, doc in _GAUGES:
        family = GaugeMetricFamily(
            name,
            f"{doc}, per model, over the whole cluster (with Redis every router reports the "
            "same: take the max over routers, not the sum). For autoscaling.",
            labels=["model"],
        )
        for model, s in sorted(per_model.items()):
            family.add_metric([model], getattr(s, field))
        yield family
