"""The gauges of ``/metrics``, read from the registry and the dispatcher at scrape time."""

from __future__ import annotations

from collections import Counter, defaultdict

from shoal.protocol.ids import ModelName
from shoal.protocol.telemetry import GpuSample
from shoal.router.deployments.controller import Deployments
from shoal.router.deployments.deployment import TunnelBytes
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.workers import Registry
from shoal.router.observe.autoscaling import ModelSignals, WorkerSlots, signals
from shoal.router.observe.gpu_metrics import worker_labels
from shoal.router.observe.metrics import Snapshot
from shoal.router.observe.model_metrics import ModelSample, sample_of


def snapshot(registry: Registry, dispatcher: Dispatcher, deployments: Deployments) -> Snapshot:
    workers = Counter(w.backend_state.value for w in registry)
    free: dict[str, int] = defaultdict(int)
    for w in registry:
        load = w.load() if w.ready else None
        for m in w.models:
            # a model's own slots where it has them (several text models), else the worker's
            running, slots = load.occupancy(m.name) if load is not None else (0, 0)
            free[m.name] += max(slots - running, 0)
    # Every model served anywhere has a series (0 when nothing waits); the depths are the
    # cluster's with Redis (see ``Dispatcher.queue_depths``).
    served = {m.name for w in registry for m in w.models}
    served |= {m.name for r in dispatcher.remote_workers() for m in r.models}
    depth: dict[str, int] = dict.fromkeys(served, 0)
    for model, waiting in dispatcher.queue_depths().items():
        depth[model] = waiting
    shards = {
        d.name: dict(Counter(s.state.value for s in d.shards)) for d in deployments.items.values()
    }
    relayed = [d.name for d in deployments.items.values() if d.spec.mode == "relayed"]
    return Snapshot(
        queue_depth=depth,
        workers=dict(workers),
        ready_slots=dict(free),
        shards=shards,
        key_queue_depth=dict(dispatcher.waiting_by_key()),
        tunnel_bytes={name: _pair(deployments.tunnels.traffic(name)) for name in relayed},
        gpus=_gpus(registry),
        autoscaling=autoscaling(registry, dispatcher),
        models=_models(registry),
    )


def autoscaling(registry: Registry, dispatcher: Dispatcher) -> dict[ModelName, ModelSignals]:
    """The scaling signals per model (``autoscaling.py``): this router's workers as they are,
    the other routers' as of the directory's last sync, the queue as of its last snapshot."""
    local = (
        WorkerSlots(
            models=tuple(m.name for m in w.models),
            slots=w.slots,
            running=len(w.running),
            takes_jobs=w.available,
            draining=w.draining,
        )
        for w in registry
    )
    remote = (
        WorkerSlots(
            models=tuple(m.name for m in r.models),
            slots=int(r.summary.get("slots", 0)),
            running=int(r.summary.get("running_jobs", 0)),
            takes_jobs=r.takes_jobs,
            draining=r.draining,
        )
        for r in dispatcher.remote_workers()
    )
    return signals([*local, *remote], dispatcher.queue_depths(), dispatcher.oldest_waits())


def _gpus(registry: Registry) -> dict[str, tuple[GpuSample, ...]]:
    """Each worker's GPU telemetry by its ``worker`` label (``gpu_metrics.worker_labels``)."""
    reporting = [w for w in registry if w.gpu_telemetry]
    labels = worker_labels((w.id, w.name) for w in reporting)
    return {labels[w.id]: w.gpu_telemetry for w in reporting}


def _models(registry: Registry) -> dict[tuple[str, str], ModelSample]:
    """Each model's residency figures per worker (``model_metrics``), by ``worker`` label."""
    samples = [(w, m, s) for w in registry for m in w.models if (s := sample_of(m)) is not None]
    labels = worker_labels((w.id, w.name) for w in {w.id: w for w, _, _ in samples}.values())
    return {(m.name, labels[w.id]): s for w, m, s in samples}


def _pair(t: TunnelBytes) -> tuple[int, int]:
    return (t.to_stages, t.to_head)
