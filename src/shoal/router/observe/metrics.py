"""The router's Prometheus metrics: hot-path calls in, exposition text out.

Two kinds of metrics, kept apart so nothing has to be kept in sync:

* **Events** (requests, first tokens, inter-token gaps, tokens, queue waits, finished jobs)
  are counted by explicit calls from the request path, each O(1).
* **State** (queue depth, workers by state, free slots, deployment shards, GPU telemetry) is
  read at scrape time from a ``Snapshot`` that a callback builds from the live registry and
  dispatcher.
  With Redis, workers and free slots are this router's own (each router is scraped, so the
  cluster's are the sum over routers), while the queue depth is the cluster's (the same on
  every router); ``/health`` and ``/v1/models`` show the cluster's workers.

Every ``Metrics`` owns its own ``CollectorRegistry`` (never the process-global one), so
several routers can run in one process. All calls, and ``render``, belong on the router's
event loop thread: the per-chunk histogram takes no lock, and the snapshot callback reads
dispatcher state that only that thread may touch.

Label values must come from bounded sets: ``route`` is a route template (never a raw path),
``model`` a model that passed the dispatcher's "is it served" check.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.protocol.ids import ModelName
from shoal.protocol.messages import BackendState
from shoal.protocol.telemetry import GpuSample
from shoal.router.observe.autoscaling import ModelSignals
from shoal.router.observe.autoscaling import families as autoscaling_families
from shoal.router.observe.gpu_metrics import gpu_families
from shoal.router.observe.model_metrics import ModelSample, model_families

# Buckets (upper bounds, seconds). Prometheus histograms are only as good as their buckets:
# each range covers what a user of a small self-hosted cluster can see, with finer steps
# where the interesting values live.

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
"""Time to first token, from submit to the first streamed chunk: 5 ms (a warm, idle GPU and
a short prompt) to 60 s (a long prompt on CPU, or a model loading again after an idle unload).
"""

INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.0,
)
"""Gap between streamed chunks: 1 ms (1000 tok/s; chunks the worker sent in one frame land
here as 0) to 2 s (0.5 tok/s, a big model on CPU). Finest at 10-100 ms, typical decode speeds.
"""

_TO_FIVE_MINUTES = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""50 ms to 5 min, the scale of every wait a client sees (queue and request below)."""

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, *_TO_FIVE_MINUTES)
"""Wait for a worker slot: ~0 when a slot is free (the common case), up to the router's wait
limit (``max_wait``, 60 s by default) and beyond for raised limits."""

REQUEST_BUCKETS = (0.005, 0.01, 0.025, *_TO_FIVE_MINUTES, 600.0)
"""Whole request, first byte in to last byte out: 5 ms (a model list) to 10 min (a long
generation on CPU)."""

MAX_KEY_LABELS = 50
"""Per-key series at most: key ids are bounded by the key database, but a busy cluster has
many; the rest are counted together."""
OTHER_KEYS = "other"

UNMATCHED_ROUTE = "unmatched"
"""The ``route`` label of requests no route matched (scanners would otherwise make a label
value per probed path)."""

WORKER_STATES = tuple(state.value for state in BackendState)


# ------------------------------------------------------------------ state read at scrape time


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The cluster's state at one instant, as the scrape-time gauges need it."""

    queue_depth: Mapping[str, int] = field(default_factory=dict)
    """Model -> requests waiting for a worker (over all its endpoints); with Redis, those of
    every router on it (``Dispatcher.queue_depths``)."""
    workers: Mapping[str, int] = field(default_factory=dict)
    """Backend state (``BackendState`` value) -> connected workers in it."""
    ready_slots: Mapping[str, int] = field(default_factory=dict)
    """Model -> free slots on ready workers serving it (a model's own slots where it has them,
    else a worker's slots count for each of its models)."""
    shards: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Deployment -> shard state -> shards in it (distributed-inference deployments)."""
    key_queue_depth: Mapping[str, int] = field(default_factory=dict)
    """API key id (or ``anonymous``/flag tenant) -> its requests waiting in this router."""
    tunnel_bytes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Deployment -> bytes its RPC tunnels carried through this router (to the stages, to
    the head), since this router started running it."""
    gpus: Mapping[str, Sequence[GpuSample]] = field(default_factory=dict)
    """Worker label -> its GPUs' latest telemetry (``gpu_metrics``: this router's workers)."""
    autoscaling: Mapping[ModelName, ModelSignals] = field(default_factory=dict)
    """Model -> its scaling signals over the whole cluster (``autoscaling``)."""
    models: Mapping[tuple[str, str], ModelSample] = field(default_factory=dict)
    """(model, worker label) -> its residency figures (``model_metrics``: this router's
    workers)."""


SnapshotSource = Callable[[], Snapshot]


# ------------------------------------------------------------------ a lock-free histogram


class _Series:
    __slots__ = ("counts", "total")

    def __init__(self, n_buckets: int) -> None:
        self.counts = [0] * n_buckets
        self.total = 0.0


class LoopHistogram:
    """A histogram with one label, for the per-chunk path: one dict get, one bisect, no lock.

    ``prometheus_client.Histogram`` takes a lock per bucket increment and scans the bounds
    linearly (~1 µs per observe with a cached child, ~1.7 µs through ``labels()``); this costs
    ~0.2 µs. It is only safe from one thread, which the router's event loop guarantees.
    """

    def __init__(self, name: str, documentation: str, label: str, bounds: Iterable[float]):
        self.name = name
        self.documentation = documentation
        self.label = label
        self.bounds = tuple(sorted(bounds))
        if not self.bounds or len(set(self.bounds)) < len(self.bounds):
            raise ValueError(f"{name}: give distinct bucket bounds, got {self.bounds}")
        if not all(math.isfinite(b) for b in self.bounds):
            raise ValueError(f"{name}: bucket bounds must be finite (+Inf is implied)")
        # Bounds spelled as prometheus_client spells them (repr below 1e6), then +Inf.
        self._les = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        self._series: dict[str, _Series] = {}

    def observe(self, value: str, amount: float) -> None:
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = _Series(len(self.bounds) + 1)
        # bisect_left: the first bound >= amount, i.e. Prometheus' "le" bucket.
        series.counts[bisect.bisect_left(self.bounds, amount)] += 1
        series.total += amount

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, series in self._series.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._les, series.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric([value], buckets, sum_value=series.total)
        return family


# ------------------------------------------------------------------ the collector


class _ScrapeCollector:
    """Gauges from a fresh snapshot, plus the lock-free histograms, at each scrape."""

    def __init__(self, source: SnapshotSource, histograms: tuple[LoopHistogram, ...]) -> None:
        self.source = source
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        snap = self.source()
        yield _gauge(
            "shoal_queue_depth",
            "Requests waiting for a worker, per model (with Redis the cluster's, the same on "
            "every router: do not sum over routers).",
            "model",
            snap.queue_depth,
        )
        workers = {state: 0 for state in WORKER_STATES} | dict(snap.workers)
        yield _gauge(
            "shoal_workers",
            "Workers connected to this router, by backend state (with Redis, sum over routers "
            "for the cluster; /health counts every router's).",
            "state",
            workers,
        )
        yield _gauge(
            "shoal_ready_slots",
            "Free slots on ready workers connected to this router, per model they serve (with "
            "Redis, sum over routers for the cluster).",
            "model",
            snap.ready_slots,
        )
        yield _gauge(
            "shoal_key_queue_depth",
            "Requests waiting for a worker in this router's queues, per API key id (fair "
            "scheduling's tenants; at most MAX_KEY_LABELS keys, the rest as 'other').",
            "key",
            bounded(snap.key_queue_depth),
        )
        shards = GaugeMetricFamily(
            "shoal_deployment_shards",
            "Shards of distributed-inference deployments, by state.",
            labels=["deployment", "state"],
        )
        for deployment, states in sorted(snap.shards.items()):
            for state, count in sorted(states.items()):
                shards.add_metric([deployment, state], count)
        yield shards
        tunnel = CounterMetricFamily(
            "shoal_tunnel_bytes",
            "Bytes relayed through this router's RPC tunnels, per split-model deployment and "
            "direction (to_stages: weights at load and activations; to_head: results).",
            labels=["deployment", "direction"],
        )
        for deployment, (to_stages, to_head) in sorted(snap.tunnel_bytes.items()):
            tunnel.add_metric([deployment, "to_stages"], to_stages)
            tunnel.add_metric([deployment, "to_head"], to_head)
        yield tunnel
        yield from gpu_families(snap.gpus)
        yield from model_families(snap.models)
        yield from autoscaling_families(snap.autoscaling)
        for histogram in self.histograms:
            yield histogram.family()


def bounded(per_key: Mapping[str, int]) -> dict[str, int]:
    """The largest ``MAX_KEY_LABELS`` keys as they are, the others summed as ``other``."""
    ranked = sorted(per_key.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(ranked[:MAX_KEY_LABELS])
    rest = sum(n for _, n in ranked[MAX_KEY_LABELS:])
    return kept | ({OTHER_KEYS: rest} if rest else {})


def _gauge(name: str, doc: str, label: str, values: Mapping[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value, count in sorted(values.items()):
        family.add_metric([value], count)
    return family


# ------------------------------------------------------------------ the metrics


class Metrics:
    """The router's metrics, on a registry of their own."""

    def __init__(self, snapshot: SnapshotSource) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "shoal_requests_total",
            "HTTP requests answered, by route template and status code.",
            ["route", "status"],
            registry=r,
        )
        self._request_seconds = Histogram(
            "shoal_request_duration_seconds",
            "HTTP request duration, first byte in to last byte out, by route template.",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self._ttft = Histogram(
            "shoal_time_to_first_token_seconds",
            "Time from submit to the first streamed chunk, per model (streamed requests).",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._tokens = Counter(
            "shoal_tokens_total",
            "Tokens processed, per model: direction=in (prompt) or out (completion).",
            ["model", "direction"],
            registry=r,
        )
        self._prompt_tokens = Counter(
            "shoal_prompt_tokens_total",
            "Prompt tokens of answered requests, per model: source=computed (evaluated by the "
            "backend) or cached (reused from its prompt cache; prefix routing raises this).",
            ["model", "source"],
            registry=r,
        )
        self._queue_wait = Histogram(
            "shoal_queue_wait_seconds",
            "Time a job waited in the queue before a worker took it, per model.",
            ["model"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self._key_queue_wait = Histogram(
            "shoal_key_queue_wait_seconds",
            "Time a job waited in the queue before a worker took it, per API key id (at most "
            "MAX_KEY_LABELS keys, later ones as 'other').",
            ["key"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self._key_labels: set[str] = set()
        self._jobs = Counter(
            "shoal_jobs_total",
            "Jobs finished, per model and outcome (succeeded, failed, cancelled).",
            ["model", "outcome"],
            registry=r,
        )
        self._resumed = Counter(
            "shoal_jobs_resumed_total",
            "Answers resumed on another worker after theirs was lost mid-answer, per model and "
            "reason (connection, heartbeat, stall, backend, preempted).",
            ["model", "reason"],
            registry=r,
        )
        self._preempted = Counter(
            "shoal_jobs_preempted_total",
            "Answers paused on their slot for a waiting job of a key below its share; each goes "
            "on later where it stopped (also counted in shoal_jobs_resumed_total, reason "
            "preempted).",
            ["model"],
            registry=r,
        )
        self._resume_seconds = Histogram(
            "shoal_resume_seconds",
            "Time from losing a job's worker mid-answer to the resumed answer's first chunk.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._inter_token = LoopHistogram(
            "shoal_inter_token_seconds",
            "Gap between consecutive streamed chunks of a job as the router receives them.",
            "model",
            INTER_TOKEN_BUCKETS,
        )
        r.register(_ScrapeCollector(snapshot, (self._inter_token,)))

    # Per request --------------------------------------------------------------

    def request_finished(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route, str(status)).inc()
        self._request_seconds.labels(route).observe(seconds)

    def first_token(self, model: str, seconds_since_submit: float) -> None:
        self._ttft.labels(model).observe(seconds_since_submit)

    def tokens(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._tokens.labels(model, "in").inc(prompt_tokens)
        self._tokens.labels(model, "out").inc(completion_tokens)

    def prompt_cache(self, model: str, cached: int, prompt_tokens: int) -> None:
        self._prompt_tokens.labels(model, "cached").inc(cached)
        self._prompt_tokens.labels(model, "computed").inc(prompt_tokens - cached)

    def queue_wait(self, model: str, key: str, seconds: float) -> None:
        self._queue_wait.labels(model).observe(seconds)
        if key not in self._key_labels and len(self._key_labels) < MAX_KEY_LABELS:
            self._key_labels.add(key)
        self._key_queue_wait.labels(key if key in self._key_labels else OTHER_KEYS).observe(seconds)

    def job_finished(self, model: str, outcome: str) -> None:
        self._jobs.labels(model, outcome).inc()

    def job_resumed(self, model: str, reason: str) -> None:
        self._resumed.labels(model, reason).inc()

    def job_preempted(self, model: str) -> None:
        self._preempted.labels(model).inc()

    def resumed_output(self, model: str, seconds_since_loss: float) -> None:
        self._resume_seconds.labels(model).observe(seconds_since_loss)

    # Per chunk ----------------------------------------------------------------

    def inter_token(self, model: str, seconds: float) -> None:
        """One streamed chunk's gap since the previous one (~0.2 µs: no lock, no labels())."""
        self._inter_token.observe(model, seconds)

    # Scrape -------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


# ------------------------------------------------------------------ requests outside the fast path


class RequestMetrics:
    """ASGI middleware: one ``request_finished`` per HTTP request, labelled by route template.

    Wrap the FastAPI app with it (inside ``FastPath``, which reports its own three routes):
    it only watches for ``http.response.start`` and passes everything else straight on.
    The route template comes from ``scope["route"]``, which Starlette's router sets in place.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500  # if the app raises before answering, the server answers 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.request_finished(route_template(scope), status, time.monotonic() - start)


def route_template(scope: Scope) -> str:
    """The matched route's path template (``/v1/models/{model_id:path}``), or ``unmatched``."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE
