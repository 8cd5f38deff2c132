"""The worker's one settings object."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from shoal.llama_cpp.options import LlamaCppOptions
from shoal.protocol.messages import WS_PATH

REDIS_SCHEMES = frozenset({"redis", "rediss", "unix"})
DEFAULT_STALL_TIMEOUT_S = 10.0
"""``--backend-stall-timeout``'s default (``text/stall.py``)."""
MIN_STALL_TIMEOUT_S = 1.0


WS_SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}
"""The schemes a --router-url may have, and what the worker dials for each."""


def has_scheme(router_url: str) -> bool:
    return "://" in router_url


def router_ws_url(router_url: str, *, tls: bool = False) -> str:
    """``host:port``, ``http(s)://host[:port]`` or ``ws(s)://host[:port]`` -> the URL the worker
    dials: ``ws(s)://host:port/ws/worker``; a ``ValueError`` saying what to fix for one that
    cannot reach a router's worker socket.

    ``host:port`` alone is ``wss://`` with ``tls`` (a worker given --tls-ca means TLS), else
    ``ws://``; it needs its port (``127.0.0.1`` alone would dial port 80, where no router
    listens by default). A URL with a scheme may leave the port out (80 for ws/http, 443 for
    wss/https: a router behind a proxy). The path is the workers' (``/ws/worker``, added when
    missing; a proxy may put a prefix before it); any other path (the clients' ``/v1``,
    pasted from ``shoal up``'s banner) is refused, naming what to drop.
    """
    given = router_url.strip()
    if has_scheme(given):
        scheme, rest = given.split("://", 1)
        dial = WS_SCHEMES.get(scheme.lower())
        if dial is None:
            raise ValueError(
                f"{given!r} has the unknown scheme {scheme!r}: give ws:// or wss:// (http:// "
                "and https:// mean the same), or host:port"
            )
    else:
        dial, rest = ("wss" if tls else "ws"), given
    parts = urlsplit("//" + rest)
    query = f"?{parts.query}" if parts.query else ""
    return f"{dial}://{_netloc(given, parts)}{_path(given, parts.path)}{query}"


def _netloc(given: str, parts: SplitResult) -> str:
    if not parts.hostname:
        raise ValueError(f"{given!r} names no host: give the router's, e.g. router.lan:8000")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ValueError(f"{given!r}: the port must be a number from 1 to 65535")
    if port is None and not has_scheme(given):
        raise ValueError(
            f"{given!r} has no port: give the router's --port (8000 by default), e.g. "
            f"{parts.netloc}:8000"
        )
    return parts.netloc


def _path(given: str, path: str) -> str:
    path = path.rstrip("/")
    if not path:
        return WS_PATH
    if path.endswith(WS_PATH):
        return path
    trimmed = given.rstrip("/")
    hint = f": give {trimmed.removesuffix(path)}" if trimmed.endswith(path) else ""
    raise ValueError(
        f"{given!r} has the path {path}, which is not the router's worker socket: workers dial "
        f"{WS_PATH}, added for you; drop {path}{hint}"
    )


class WorkerSettings(LlamaCppOptions):
    router_url: str = Field(
        "127.0.0.1:8000",
        description="The router to dial: host:port (ws://, or wss:// with --tls-ca), or a "
        "ws:// or wss:// URL. Several, comma-separated (routers sharing one Redis): the worker "
        "fails over between them.",
    )
    gpu_key: SecretStr | None = Field(
        None, description="Key this worker presents to the router (the router's --gpu-key)."
    )
    tls_ca: Path | None = Field(
        None,
        description="CA certificate (PEM) that signed the router's TLS certificate, for a "
        "wss:// router with a private CA (default: the system's trusted CAs); a --router-url "
        "without a scheme then means wss://.",
    )
    redis_url: SecretStr | None = Field(
        None,
        description="Pull mode: take jobs straight from this Redis (the routers' --redis-url, "
        "e.g. redis://:PASSWORD@HOST:6379/0) instead of dialing a router; --router-url and "
        "--gpu-key are then unused.",
    )
    redis_prefix: str = Field(
        "shoal:", description="With --redis-url: prefix of every Redis key (the routers' value)."
    )
    queue_lease: float = Field(
        30.0,
        ge=3.0,
        description="With --redis-url: seconds after which a job whose holder stopped renewing "
        "it is taken over; use the routers' lease (their --queue-lease, by default twice their "
        "heartbeat timeout: 30 s).",
    )
    resume_attempts: int = Field(
        2,
        ge=0,
        description="With --redis-url: times a streamed answer goes on on another worker when "
        "this worker's llama-server dies mid-answer (the routers' --resume-attempts).",
    )
    name: str = Field(default_factory=socket.gethostname, description="Name shown for this worker.")
    model: str | None = Field(
        None,
        description="Model to serve: a catalog id (`shoal models list`), a Hugging Face GGUF "
        "repo (org/repo, org/repo:Q4_K_M or org/repo:FILE.gguf, hf.co/ optional), a path to a "
        ".gguf file, or a model-store id with --model-store. Default: the router's default "
        "model (with --redis-url: Shoal's default model). Repeat it (or give several, "
        "comma-separated) to serve several text models, loaded as memory allows.",
        json_schema_extra={"repeatable": True},
    )
    models_file: Path | None = Field(
        None,
        description="TOML or YAML file of the text models to serve, with per-model options "
        "(alias, ctx_size, slots, llama_server_args, pinned, preload, idle_unload, "
        "quantization); see the README's 'Several models per worker'.",
    )
    memory_budget: float | None = Field(
        None,
        gt=0,
        description="GiB: cap the memory resident text models may hold together (default: the "
        "free RAM and VRAM at start); for operators and benchmarks.",
    )
    model_path: Path | None = Field(
        None,
        description="Serve this local .gguf file (air-gapped: nothing is downloaded). Its "
        "public name is --model-alias, else --model, else the file name.",
    )
    quantization: str | None = Field(
        None,
        description="Quantization to download for a catalog model or Hugging Face repo (e.g. "
        "Q4_K_M). Default: the "
        "best one that fits this machine's free memory.",
    )
    offline: bool = Field(
        False,
        description="Never download: use only cached or pre-staged models (as HF_HUB_OFFLINE=1).",
    )
    gpu_devices: str | None = Field(
        None,
        description="Comma-separated GPU indices to use (as nvidia-smi/rocm-smi number them); "
        "the model is split across them by free memory. 'none': compute on the CPU only (its "
        "llama-server gets --device none, split-model stages -d CPU). Default: all.",
    )
    split_mode: Literal["layer", "row", "none"] = Field(
        "layer", description="How llama.cpp splits a model across several GPUs."
    )
    idle_unload: float = Field(
        0.0,
        ge=0,
        description="Stop llama-server after this many idle seconds to free memory; it loads "
        "again on the next job, which waits. 0 keeps it loaded.",
    )
    model_store: str | None = Field(
        None,
        description="Fetch --model from this model store (shoal data, or a router with "
        "--storage) instead of the local cache; resumable. The GPU key is sent as the key.",
    )
    model_store_mount: Path | None = Field(
        None,
        description="The --model-store's storage folder as this machine mounts it (NFS, a "
        "bind mount; its path here may differ from the store's): models are read from there "
        "instead of downloaded, when the file is there with the store's size.",
    )
    model_alias: str | None = Field(
        None, description="Public model name clients use (default: the model id)."
    )
    backend_url: str | None = Field(
        None,
        description="Attach to an already running OpenAI-compatible server (llama-server, "
        "vLLM, Ollama) at this URL instead of starting llama-server.",
    )
    backend_model: str | None = Field(
        None,
        description="Model name to send to the attached backend (default: the first one it lists).",
    )
    backend_api_key: SecretStr | None = Field(
        None, description="API key for the attached backend, if it needs one."
    )
    image_model: str | None = Field(
        None,
        description="Image model to serve (txt2img/img2img), alone or next to --model: a "
        "diffusers pipeline folder, a .safetensors checkpoint, or a Hugging Face repo id; "
        "several, comma-separated, to switch between them on request. Needs the image extra: "
        "pip install 'shoal[image]'.",
    )
    image_model_alias: str | None = Field(
        None,
        description="Public name of the (one) image model (default: its folder, file or repo "
        "name).",
    )
    image_max_loaded: int = Field(
        1,
        ge=1,
        description="Image models kept in memory at once; a job for another one unloads the "
        "one used longest ago first.",
    )
    image_backend_url: str | None = Field(
        None,
        description="Serve images from an Automatic1111/Forge-compatible server at this URL "
        "(its /sdapi/v1 API) instead of loading a model here; --image-model then names the "
        "checkpoint it should switch to (default: whatever it has loaded).",
    )
    image_device: str | None = Field(
        None, description="PyTorch device for --image-model (default: cuda when present, else cpu)."
    )
    image_config: str | None = Field(
        None,
        description="For a single-file --image-model checkpoint: a diffusers pipeline folder "
        "(its JSON configs are enough) or Hub repo id of the same architecture (default: a "
        "folder next to the checkpoint named like it, else diffusers fetches configs from the "
        "Hub, which needs a connection).",
    )
    image_slots: int = Field(
        1,
        ge=1,
        le=64,
        description="Image jobs a worker without a text model takes at once (they run one "
        "after another on its one pipeline; more only queue here instead of at the router).",
    )
    slots: int = Field(4, ge=1, le=4096, description="Requests served at once (llama-server -np).")
    ctx_size: int = Field(
        4096, ge=256, description="Context length per slot (llama-server gets ctx-size x slots)."
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for llama-server and for split-model stages (default: "
        "llama-server takes the cores that the llama.cpp servers already running on this "
        "machine leave free, at least one, and warns when they are too few; stages one per "
        "physical core).",
    )
    embedding: bool = Field(
        False, description="Serve embeddings (/v1/embeddings) instead of completions."
    )
    llama_server_args: str = Field(
        "", description="Extra arguments for llama-server, as one shell-quoted string."
    )
    max_restarts: int = Field(
        5, ge=0, description="Crashes within a minute after which llama-server is not restarted."
    )
    backend_stall_timeout: float = Field(
        DEFAULT_STALL_TIMEOUT_S,
        ge=0,
        description="Seconds llama-server may leave /health unanswered while it runs jobs "
        "before it is taken for hung (stopped, frozen): it is killed and restarted, and its "
        "answers go on on other workers. It answers /health while it computes, however long "
        "the prompt. 0: off (a hang is then found by three failed health checks 10 s apart).",
    )
    drain_timeout: float = Field(
        25.0,
        ge=0,
        description="Seconds a worker told to stop (SIGTERM) drains before it stops: it takes "
        "no new job and finishes those it runs; any still running then go on on another "
        "worker. Keep it below the grace period of what stops it (Kubernetes' "
        "terminationGracePeriodSeconds, 30 s by default; Docker's stop timeout, 10 s). A "
        "second SIGTERM, or SIGINT (Ctrl-C), stops it at once.",
    )
    kv_save_limit: float = Field(
        4.0,
        ge=0,
        description="GiB of slots' KV caches kept on disk (in kv-saves/ under the cache "
        "folder), oldest dropped first: a model evicted to make room for another saves its "
        "slots' prompts and gets them back when it loads again; 0 turns saving off.",
    )
    rpc_host: str | None = Field(
        None,
        description="Direct mode for split models, trusted networks only: the IPv4 address "
        "this worker's ggml-rpc-server (which has no authentication) listens on for a head to "
        "dial. Default: it listens on 127.0.0.1 only, reached through the router's tunnel.",
    )
    rpc_cache_max: float = Field(
        64.0,
        ge=0,
        description="GiB of split-model weights this worker keeps in ggml-rpc-server's tensor "
        "cache (least recently used out). A stage pre-seeds its layers there, so a head sends "
        "it no weights; 0 turns the cache and pre-seeding off.",
    )
    shard_ram: float | None = Field(
        None,
        gt=0,
        description="GiB of RAM at most that split models' shards may plan on here (the "
        "router plans with the smaller of this and the RAM free). Default: all the RAM free.",
    )
    rpc_cache_dir: Path | None = Field(
        None,
        description="The folder that holds that cache (in rpc-cache/<llama.cpp build>/ "
        "below it); default: the cache folder.",
    )

    @field_validator("router_url")
    @classmethod
    def _router_url_ok(cls, value: str) -> str:
        urls = [u.strip() for u in value.split(",") if u.strip()]
        if not urls:
            raise ValueError("give at least one router URL (host:port, or a ws:// or wss:// URL)")
        for url in urls:
            router_ws_url(url)  # raises what is wrong with it
        return value

    @field_validator("rpc_host")
    @classmethod
    def _rpc_host_ok(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ipaddress.IPv4Address(value)
            except ValueError:
                raise ValueError(
                    f"rpc_host must be an IPv4 address (ggml-rpc-server takes no names), "
                    f"got {value!r}"
                ) from None
        return value

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("name must not be empty")
        return value.strip()

    @field_validator("redis_url")
    @classmethod
    def _redis_url_ok(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and urlsplit(value.get_secret_value()).scheme not in REDIS_SCHEMES:
            raise ValueError(
                "redis_url must start with redis://, rediss:// or unix:// "
                "(e.g. redis://127.0.0.1:6379/0)"
            )
        return value

    @field_validator("backend_stall_timeout")
    @classmethod
    def _stall_timeout_ok(cls, value: float) -> float:
        if 0 < value < MIN_STALL_TIMEOUT_S:
            raise ValueError(
                f"backend_stall_timeout must be 0 (off) or at least {MIN_STALL_TIMEOUT_S:g} s, "
                f"got {value:g}: a busy machine may take a moment to answer /health"
            )
        return value

    @model_validator(mode="after")
    def _mount_of_a_store(self) -> WorkerSettings:
        if self.model_store_mount is not None and self.model_store is None:
            raise ValueError(
                "--model-store-mount is the folder of a --model-store mounted here; give the "
                "store too (--model-store URL), which says which file a model is"
            )
        return self

    @model_validator(mode="after")
    def _images_not_in_pull_mode(self) -> WorkerSettings:
        if self.redis_url is not None and (self.image_model or self.image_backend_url):
            raise ValueError(
                "image models are not served in pull mode (--redis-url) yet; run the image "
                "worker against a router (--router-url)"
            )
        return self

    @property
    def serves_images(self) -> bool:
        """Image models are named (``--image-model`` or ``--image-backend-url``)."""
        return bool(self.image_model or self.image_backend_url)

    @property
    def models(self) -> tuple[str, ...]:
        """The text models named by ``--model`` (repeated or comma-separated)."""
        return tuple(m.strip() for m in (self.model or "").split(",") if m.strip())

    @property
    def several_models(self) -> bool:
        """Several text models, each its own llama-server (``text/residency/``)."""
        return self.models_file is not None or len(self.models) > 1

    @property
    def router_urls(self) -> tuple[str, ...]:
        """The routers as given."""
        return tuple(u.strip() for u in self.router_url.split(",") if u.strip())

    @property
    def ws_urls(self) -> tuple[str, ...]:
        tls = self.tls_ca is not None
        return tuple(router_ws_url(u, tls=tls) for u in self.router_urls)

    @property
    def inferred_wss(self) -> tuple[str, ...]:
        """The routers given as host:port that are dialed over wss:// because of --tls-ca."""
        if self.tls_ca is None:
            return ()
        return tuple(u for u in self.router_urls if not has_scheme(u))
