"""The router's one settings object."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator

from shoal.models.default import DEFAULT_MODEL
from shoal.security import is_loopback
from shoal.settings import (
    KEEP_ALIVE_S,
    CommaList,
    SecretList,
    TlsServerSettings,
    server_variable,
    split_commas,
)

ROUTER_API_KEY_VARIABLE = server_variable("router", "api_key")
"""``--api-key``'s variable: the router's own (a client's shell holds OPENAI_API_KEY)."""
MODEL_STORE_VARIABLE = server_variable("router", "model_store")
"""``--model-store``'s variable: not a worker's ``SHOAL_MODEL_STORE`` (a worker fetches its one
model from there)."""
MODEL_STORE_KEY_VARIABLE = server_variable("router", "model_store_key")


class RouterSettings(TlsServerSettings):
    host: str = Field("127.0.0.1", description="Address to listen on (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    api_key: Annotated[SecretList, ROUTER_API_KEY_VARIABLE] = Field(
        (),
        description="Comma-separated API keys clients may present (Authorization: Bearer), "
        "besides the key database's (`shoal keys create`); valid until the router stops "
        "(`shoal keys revoke` reaches only the database's).",
    )
    gpu_key: SecretList = Field(
        (),
        description="Comma-separated keys workers may present to join, besides the key "
        "database's worker keys.",
    )
    admin_key: SecretList = Field(
        (),
        description="Comma-separated admin keys (dashboard, /metrics, usage, workers, deployments, "
        "uploads), besides the key database's admin keys.",
    )
    storage: Path | None = Field(
        None,
        description="Also serve the GGUF files in this folder as a model store "
        "(/api/v1/models/...), for workers and the deployments planner.",
    )
    model_store: Annotated[CommaList, MODEL_STORE_VARIABLE] = Field(
        (),
        description="Comma-separated URLs of model stores (shoal data) to find split models in: "
        "a model id in deploy or plan that is neither a catalog model here nor a path is "
        "looked up in --storage, then in these in order (only its GGUF header is read here). "
        "Workers fetch it from the store that has it, with their --gpu-key.",
    )
    model_store_key: Annotated[SecretStr | None, MODEL_STORE_KEY_VARIABLE] = Field(
        None, description="The key the router reads the --model-store stores with."
    )
    model_store_ca: Path | None = Field(
        None,
        description="PEM CA certificate to verify HTTPS --model-store stores with (default: "
        "the system's CAs).",
    )
    default_model: str = Field(
        DEFAULT_MODEL.id,
        description="Model used when a request names none.",
    )
    max_queue: int = Field(
        256, ge=0, description="Requests that may wait per model before new ones get 429."
    )
    max_wait: float = Field(
        60.0, gt=0, description="Seconds a request may wait for a free worker before a 503."
    )
    scheduling: Literal["fair", "fifo"] = Field(
        "fair",
        description="Order of the requests waiting for a model: fair (API keys share the "
        "workers by work done; async jobs wait for interactive requests) or fifo (arrival).",
    )
    preempt: bool = Field(
        True,
        description="With --scheduling fair: a waiting request of a key below its share of "
        "the slots may pause a running answer of a key above its share, which then goes on "
        "exactly where it stopped (its client's stream just pauses). In-process queue only: "
        "with --redis-url nothing is paused.",
    )
    routing: Literal["prefix", "least-loaded"] = Field(
        "prefix",
        description="Which worker a request goes to: prefix (the one whose llama-server "
        "already holds the longest part of its prompt, until that worker is full) or "
        "least-loaded.",
    )
    prefix_hold: float = Field(
        0.5,
        ge=0,
        description="With --redis-url and prefix routing: seconds a request waits in Redis for "
        "the router whose worker (or the pull worker that) holds its prompt's prefix (and has a "
        "free slot) before anyone takes it; 0: anyone takes it at once. Below --max-wait.",
    )
    job_timeout: float = Field(
        0.0,
        ge=0,
        description="Most seconds a request may take, from its arrival to its answer's end "
        "(waiting for a worker, running, going on on another worker), before it fails with a "
        "504 job_timeout error (a stream already started ends with that error event) and its "
        "worker stops it; async jobs (/v1/jobs) count from their submission. 0: no limit.",
    )
    max_requeues: int = Field(
        2, ge=0, description="Times a job is handed to another worker when its worker is lost."
    )
    resume_attempts: int = Field(
        2,
        ge=0,
        description="Times a streamed answer goes on on another worker when its worker is lost "
        "mid-answer (the client's stream continues with the next token); 0: it ends with an "
        "error event.",
    )
    stall_timeout: float = Field(
        8.0,
        ge=0,
        description="Seconds without a frame from a worker that is streaming an answer, while "
        "other workers' frames keep arriving, after which it is taken for frozen and its "
        "answers go on elsewhere (sooner than the heartbeat timeout); 0: off. Kept above the "
        "heartbeat interval, so a slow but live worker (its heartbeats arrive) never stalls.",
    )
    database_url: str | None = Field(
        None,
        description="Where API keys and usage live: a SQLAlchemy URL (postgresql://..., "
        "sqlite:///path). Default: a SQLite file in Shoal's data folder.",
    )
    redis_url: str | None = Field(
        None,
        description="Redis shared with the other routers of the cluster, e.g. "
        "redis://127.0.0.1:6379/0: the job queue (any router takes any request, any worker "
        "serves it), the worker and model lists, rate limits, async jobs, the result cache "
        "and split-model deployments.",
    )
    redis_prefix: str = Field("shoal:", description="Prefix of every Redis key this cluster uses.")
    queue_lease: float | None = Field(
        None,
        gt=0,
        description="With --redis-url: seconds after which a job held by a router that stopped "
        "renewing it is taken over (and run again if it had produced nothing). Default: twice "
        "the worker heartbeat timeout.",
    )
    job_ttl: float = Field(
        3600.0, gt=0, description="Seconds an async job's result (/v1/jobs) is kept."
    )
    job_max_active: int = Field(
        1024, ge=1, description="Async jobs queued or running at once before new ones get 429."
    )
    cache: bool = Field(
        False,
        description="Answer repeated deterministic requests (temperature 0 or a fixed seed) "
        "from a result cache (Redis with --redis-url, else in memory).",
    )
    cache_ttl: float = Field(600.0, gt=0, description="Seconds a cached answer is kept.")
    cache_max_entries: int = Field(
        1024, ge=1, description="Answers the in-memory result cache keeps (least recent go)."
    )
    tunnel_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the tunnel listener that carries split models' RPC traffic "
        "between workers (authenticated per tunnel; TLS with --tls-cert). 0: any free port "
        "(workers are told which).",
    )
    rebalance_quiet_s: float = Field(
        5.0,
        ge=0,
        description="Seconds without another worker joining after which a serving split "
        "model is planned again over the workers there are, and moved (drained, then "
        "redeployed) if the new plan is better: layers off RAM onto GPUs, no worker over its "
        "memory, or the fullest worker's share of its memory down by 10 points or more.",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body accepted (bytes); else 413."
    )
    max_tokens_limit: int | None = Field(
        None,
        ge=1,
        description="Highest max_tokens (or max_completion_tokens) a request may ask for; "
        "else 400. Default: no limit beyond the model's context.",
    )
    max_messages: int = Field(
        1024, ge=1, description="Most messages a chat request may carry; else 400."
    )
    keep_alive: int = Field(
        KEEP_ALIVE_S,
        ge=1,
        description="Seconds an idle client connection is kept open. Keep it above the time "
        "clients and proxies keep idle connections (httpx 5 s, aiohttp 15 s, nginx 60 s), so "
        "that they close first and never reuse a connection the router is closing.",
    )
    heartbeat_interval: float = Field(5.0, gt=0, description="Seconds between worker heartbeats.")
    heartbeat_misses: int = Field(
        3, ge=1, description="Missed heartbeats after which a worker is dropped."
    )
    heartbeat_rate: float = Field(
        250.0,
        gt=0,
        description="Heartbeats per second this router accepts from idle workers: past "
        "--heartbeat-rate x --heartbeat-interval workers, idle workers are told to beat at "
        "twice the interval, four times... (a worker running a job beats at the base "
        "interval, and each is dropped after --heartbeat-misses of its own interval).",
    )

    _split_api = field_validator("api_key", "gpu_key", "admin_key", mode="before")(split_commas)
    _split_stores = field_validator("model_store", mode="before")(split_commas)

    @model_validator(mode="after")
    def _stall_above_heartbeats(self) -> Self:
        if 0 < self.stall_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"--stall-timeout ({self.stall_timeout:g} s) must be above "
                f"--heartbeat-interval ({self.heartbeat_interval:g} s), or 0 to turn it off: "
                "a live worker is silent for up to one heartbeat interval"
            )
        return self

    @model_validator(mode="after")
    def _hold_below_wait(self) -> Self:
        holds = self.redis_url is not None and self.routing == "prefix"
        if holds and 0 < self.max_wait <= self.prefix_hold:
            raise ValueError(
                f"--prefix-hold ({self.prefix_hold:g} s) must be below --max-wait "
                f"({self.max_wait:g} s): a request held for a router longer than it may wait "
                "would time out before anyone takes it (a hold is meant to last well under a "
                "second)"
            )
        return self

    @property
    def heartbeat_timeout(self) -> float:
        return self.heartbeat_interval * self.heartbeat_misses

    @property
    def on_loopback(self) -> bool:
        return is_loopback(self.host)
