"""The router's composition root: settings in, ASGI app and server out."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio
import redis.exceptions
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from starlette.datastructures import Headers
from starlette.types import ASGIApp

from shoal import __version__, serving
from shoal.data import routes as data_routes
from shoal.data.keys import StoreKeys
from shoal.data.store import ModelStore
from shoal.keys import KeyStore, KeyStoreError, Scope, open_store
from shoal.router import errors
from shoal.router.admission.accounting import Accounting
from shoal.router.admission.auth import KeyCheck, describe, startup_problem
from shoal.router.admission.ratelimit.interface import RateLimiter
from shoal.router.admission.ratelimit.memory import MemoryRateLimiter
from shoal.router.admission.ratelimit.redis import RedisRateLimiter
from shoal.router.admission.requests import RequestLimits
from shoal.router.admission.result_cache.interface import ResultCache
from shoal.router.admission.result_cache.memory import MemoryResultCache
from shoal.router.admission.result_cache.redis import RedisResultCache
from shoal.router.async_jobs.runner import dispatcher_runner
from shoal.router.async_jobs.service import JobsService, Owner
from shoal.router.async_jobs.store.interface import JobStore
from shoal.router.async_jobs.store.memory import MemoryJobStore
from shoal.router.async_jobs.store.redis import RedisJobStore
from shoal.router.deployments.controller import Deployments
from shoal.router.deployments.leases import DeploymentLeases
from shoal.router.deployments.pin import pin_model
from shoal.router.deployments.sources import ModelSources
from shoal.router.deployments.store import DeploymentStore
from shoal.router.deployments.tunnels import RouterTunnels
from shoal.router.dispatch.answers import UnavailableReason
from shoal.router.dispatch.interface import Dispatcher
from shoal.router.dispatch.memory import MemoryDispatcher
from shoal.router.dispatch.redis import RedisDispatcher, consumer_name
from shoal.router.dispatch.workers import Registry
from shoal.router.observe.metrics import Metrics, RequestMetrics
from shoal.router.responses.store.interface import ResponseStore
from shoal.router.responses.store.memory import MemoryResponseStore
from shoal.router.responses.store.redis import RedisResponseStore
from shoal.router.routes import (
    autoscaling,
    dashboard,
    health,
    images,
    inference,
    models,
    usage,
    worker_socket,
)
from shoal.router.routes import deployments as deployments_routes
from shoal.router.routes import jobs as jobs_routes
from shoal.router.routes import metrics as metrics_routes
from shoal.router.routes import responses as responses_routes
from shoal.router.routes.context import RouterContext
from shoal.router.routes.snapshot import snapshot
from shoal.router.settings import RouterSettings
from shoal.settings import CLIENT_KEY_VARIABLE, flag_and_variable

log = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 2.0
"""Socket timeouts of the router's Redis client: an outage costs a request this much, once."""


QUEUE_SOCKET_TIMEOUT_S = 10.0
"""Socket timeout of the job queue's Redis client: longer than its blocking reads (2 s)."""


class RouterConfigError(Exception):
    pass


class RouterApi(FastAPI):
    """FastAPI whose OpenAPI document declares the router's OpenAI-style error answers."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            self.openapi_schema = errors.document_errors(super().openapi())
        return self.openapi_schema


def build_app(settings: RouterSettings, store: KeyStore | None = None) -> inference.FastPath:
    """The router's ASGI app. ``store`` is the key database (opened here when not given)."""
    store = store or open_key_store(settings)
    sources = key_sources()
    keys = KeyCheck(
        api_keys=flag_keys(store, settings.api_key, sources[Scope.INFERENCE]),
        gpu_keys=flag_keys(store, settings.gpu_key, sources[Scope.WORKER]),
        admin_keys=flag_keys(store, settings.admin_key, sources[Scope.ADMIN]),
        store=store,
        open_when_keyless=settings.on_loopback,
    )
    client_key_set = CLIENT_KEY_VARIABLE in os.environ  # what a router read before
    problem = startup_problem(keys, settings.on_loopback, settings.host, client_key_set)
    if problem:
        raise RouterConfigError(problem)
    registry = Registry()
    app = RouterApi(
        title="Shoal router",
        version=__version__,
        description="OpenAI-compatible endpoint over workers that dial out.",
        docs_url=None,
        redoc_url=None,
    )
    metrics = Metrics(lambda: snapshot(registry, dispatcher, deployments))
    name = consumer_name()  # this router, among the routers sharing a Redis
    shared = redis_client(settings)
    model_store = _model_store(settings)
    deployments = Deployments(
        registry,
        DeploymentStore(store.engine),
        RouterTunnels(registry, settings.host, settings.tunnel_port, _tunnel_tls(settings)),
        _model_sources(settings, model_store),
        _deployment_leases(settings, shared, name),
        pin=functools.partial(pin_model, cache_dir=settings.cache_dir),
        rebalance_quiet_s=settings.rebalance_quiet_s,
    )
    dispatcher = build_dispatcher(settings, registry, metrics, name, deployments.unavailable)
    ctx = RouterContext(
        settings=settings,
        registry=registry,
        dispatcher=dispatcher,
        keys=keys,
        accounting=Accounting(rate_limiter(settings, shared), store, metrics),
        store=store,
        jobs=jobs_service(settings, shared, dispatcher),
        cache=result_cache(settings, shared),
        deployments=deployments,
        responses=response_store(settings, shared),
    )
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.state.metrics_auth = keys.admin
    errors.install(app)
    for module in (
        inference,
        responses_routes,
        images,
        models,
        health,
        autoscaling,
        deployments_routes,
        worker_socket,
        usage,
        metrics_routes,
    ):
        app.include_router(module.router)
    app.state.check_key = _owner_of(keys)
    jobs_routes.install(
        app,
        ctx.jobs,
        limits=RequestLimits.of(settings),
        default_model=settings.default_model,
        check_served=dispatcher.check_served,
    )
    dashboard.install(app)
    if model_store is not None:
        data_routes.install(
            app,
            model_store,
            access=StoreKeys(
                read=keys.api_keys + keys.gpu_keys,
                admin=keys.admin_keys,
                database=keys.store,
                open_when_keyless=keys.open_when_keyless,
            ),
        )
    return inference.FastPath(RequestMetrics(app, metrics), ctx)


def key_sources() -> dict[Scope, str]:
    """Where each scope's flag keys come from, as a user sets them (``--api-key/VARIABLE``)."""
    return {
        Scope.INFERENCE: flag_and_variable(RouterSettings, "api_key"),
        Scope.WORKER: flag_and_variable(RouterSettings, "gpu_key"),
        Scope.ADMIN: flag_and_variable(RouterSettings, "admin_key"),
    }


def flag_keys(store: KeyStore, given: tuple[SecretStr, ...], flag: str) -> tuple[SecretStr, ...]:
    """The keys given by flag or variable that are not keys of the key database.

    A database key found here (say an operator's own inference key, passed with --api-key)
    is checked in the database like any other, so revoking it works; as a flag key it would
    be accepted until the router stopped.
    """
    kept = []
    for secret in given:
        record = store.stored(secret.get_secret_value())
        if record is None:
            kept.append(secret)
        else:
            log.info("%s holds %s of the key database: checked there", flag, record.label())
    return tuple(kept)


def _tunnel_tls(settings: RouterSettings) -> ssl.SSLContext | None:
    """The tunnel listener speaks TLS with the router's certificate, when it has one."""
    tls = tls_files(settings)
    if tls is None:
        return None
    try:
        return serving.server_tls_context(tls)
    except serving.TlsError as exc:
        raise RouterConfigError(str(exc)) from None


def _deployment_leases(
    settings: RouterSettings, shared: redis.asyncio.Redis | None, name: str
) -> DeploymentLeases | None:
    """With Redis, other routers may share the deployments: one runs each (by lease)."""
    if shared is None:
        return None
    return DeploymentLeases(shared, settings.redis_prefix, name)


def _model_store(settings: RouterSettings) -> ModelStore | None:
    """The router's own model store (``--storage``), or None."""
    if settings.storage is None:
        return None
    try:
        return ModelStore(settings.storage)
    except OSError as exc:
        raise RouterConfigError(
            f"cannot use {settings.storage} as the model store: {exc.strerror}"
        ) from None


def _model_sources(settings: RouterSettings, own: ModelStore | None) -> ModelSources:
    """Where split models are found: the router's cache or paths, its store, ``--model-store``."""
    key = settings.model_store_key
    ca = settings.model_store_ca
    try:
        tls = ssl.create_default_context(cafile=ca)
    except OSError as exc:  # ssl.SSLError too: not a PEM certificate
        reason = exc.strerror or getattr(exc, "reason", None) or str(exc)
        raise RouterConfigError(
            f"cannot use {ca} as the model stores' CA certificate (--model-store-ca): {reason}. "
            "Give the PEM file of the CA that signed the stores' certificates."
        ) from None
    return ModelSources(
        settings.cache_dir,
        settings.model_store,
        api_key=key.get_secret_value() if key is not None else None,
        tls=tls,
        own_store=own,
    )


def open_key_store(settings: RouterSettings) -> KeyStore:
    """The key database, migrated; a clear error when it cannot be opened."""
    try:
        return open_store(settings.database_url)
    except KeyStoreError as exc:
        raise RouterConfigError(f"cannot open the key database: {exc}") from None


def redis_client(settings: RouterSettings) -> redis.asyncio.Redis | None:
    """The one Redis client this router's shared state goes through (None without Redis)."""
    if settings.redis_url is None:
        return None
    return redis.asyncio.Redis.from_url(
        settings.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )


def build_dispatcher(
    settings: RouterSettings,
    registry: Registry,
    metrics: Metrics,
    name: str,
    away: UnavailableReason,
) -> Dispatcher:
    """Jobs in Redis, shared with every router on it, when there is one; else in-process.

    ``name``: this router among those sharing the Redis; ``away``: why a model nobody serves
    is only away for a while (a deployment being redeployed: 503, not 404)."""
    if settings.redis_url is None:
        return MemoryDispatcher(settings, registry, metrics, away)
    queue_redis = redis.asyncio.Redis.from_url(
        settings.redis_url,
        socket_timeout=QUEUE_SOCKET_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        # A pooled connection a Redis restart broke is replaced at once, not taken for a
        # new outage (every queue call is idempotent; see ``redis_queue.scripts``).
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
    )
    return RedisDispatcher(settings, registry, queue_redis, metrics, name=name, away=away)


def rate_limiter(settings: RouterSettings, shared: redis.asyncio.Redis | None) -> RateLimiter:
    """Per-key limits shared through Redis when there is one, else in this process."""
    if shared is None:
        return MemoryRateLimiter()
    return RedisRateLimiter(shared, settings.redis_prefix)


def jobs_service(
    settings: RouterSettings, shared: redis.asyncio.Redis | None, dispatcher: Dispatcher
) -> JobsService:
    """The async jobs API: records in Redis (seen by every router) or in this process."""
    store: JobStore = (
        RedisJobStore(shared, settings.redis_prefix, settings.job_ttl)
        if shared is not None
        else MemoryJobStore(settings.job_ttl)
    )
    run = dispatcher_runner(dispatcher, settings.job_timeout)
    return JobsService(store, run, max_active=settings.job_max_active)


def response_store(settings: RouterSettings, shared: redis.asyncio.Redis | None) -> ResponseStore:
    """Stored responses (``store: true``): in Redis (every router's) or in this process; kept
    ``--job-ttl`` like async jobs' results."""
    if shared is not None:
        return RedisResponseStore(shared, settings.redis_prefix, settings.job_ttl)
    return MemoryResponseStore(settings.job_ttl)


def result_cache(
    settings: RouterSettings, shared: redis.asyncio.Redis | None
) -> ResultCache | None:
    if not settings.cache:
        return None
    if shared is not None:
        return RedisResultCache(shared, settings.redis_prefix, settings.cache_ttl)
    return MemoryResultCache(settings.cache_max_entries, settings.cache_ttl)


def _owner_of(keys: KeyCheck) -> Callable[[Headers], Awaitable[Owner]]:
    async def check(headers: Headers) -> Owner:
        principal = await keys.client(headers)
        return Owner(principal.key_id, principal.queueing)

    return check


def bind(host: str, port: int) -> socket.socket:
    try:
        return serving.bind(host, port)
    except serving.BindError as exc:
        raise RouterConfigError(str(exc)) from None


def tls_files(settings: RouterSettings) -> serving.TlsFiles | None:
    """The certificate and key to serve HTTPS and WSS with; None for plain HTTP."""
    try:
        return serving.tls_files(settings.tls_cert, settings.tls_key)
    except serving.TlsError as exc:
        raise RouterConfigError(str(exc)) from None


def build_server(settings: RouterSettings, app: ASGIApp) -> uvicorn.Server:
    try:
        return serving.build_server(
            app, websockets=True, tls=tls_files(settings), keep_alive=settings.keep_alive
        )
    except serving.TlsError as exc:
        raise RouterConfigError(str(exc)) from None


GC_GEN0_THRESHOLD = 10_000
"""Allocations between two young-generation collections (Python's default: 700). A fleet's
heartbeats allocate a few objects each; at the default the collector ran several times a
heartbeat burst, and its older generations walked the whole heap of workers."""


def tune_gc() -> None:
    """For a router process (``shoal router``): what start-up built (modules, schemas,
    routes: most of the heap) moves out of the collector's sight (``gc.freeze``), and young
    collections run every ``GC_GEN0_THRESHOLD`` allocations. Not for a process that only
    hosts a router among other things (tests)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


async def serve(
    settings: RouterSettings, sock: socket.socket | None = None, *, own_process: bool = False
) -> None:
    """Run the router until cancelled. Pass ``sock`` to serve an already bound socket;
    ``own_process``: the process is this router's alone (``tune_gc`` once it is built)."""
    try:
        app = build_app(settings)
        server = build_server(settings, app)
    except RouterConfigError:
        if sock is not None:
            sock.close()
        raise
    ctx = app.ctx
    sock = sock or bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    log.info(
        "router %s on %s://%s:%d (%s)",
        __version__,
        "https" if server.config.is_ssl else "http",
        host,
        port,
        await asyncio.to_thread(describe, ctx.keys, key_sources()),
    )
    if own_process:
        tune_gc()
    try:
        async with asyncio.TaskGroup() as tg:
            background = tg.create_task(ctx.store.run())
            queue = tg.create_task(ctx.dispatcher.run())
            controller = tg.create_task(ctx.deployments.run())
            tunnels = ctx.deployments.tunnels
            hub = tg.create_task(tunnels.serve()) if isinstance(tunnels, RouterTunnels) else None
            async with ctx.jobs.running():
                await serving.serve_on(server, sock)
            for task in (background, queue, controller, hub):
                if task is not None:
                    task.cancel()
    finally:
        await ctx.dispatcher.close()
        await asyncio.to_thread(ctx.store.close)
        await ctx.accounting.limiter.close()
