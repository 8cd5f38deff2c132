"""Router <-> worker messages: typed, frozen, versioned, JSON on the wire.

One WebSocket carries every message between a worker and its router. Each frame (text, or
binary for chunk batches) is one JSON object whose ``type`` field selects the message class;
the closed unions below are the whole vocabulary. The worker authenticates in the HTTP
upgrade request (``Authorization: Bearer``), then sends ``Register`` as its first frame; the
router answers ``Registered`` or ``Refused``. The messages of split models are in
``protocol.shards``; they are in the unions here and re-exported.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, TypeAdapter

from shoal.protocol.base import Message
from shoal.protocol.ids import JobId, ModelName, WorkerId
from shoal.protocol.shards import (
    DevicePlacement,
    LinkRtt,
    ModelFile,
    RpcPeer,
    SeedReport,
    ShardDevice,
    ShardLinks,
    ShardRole,
    ShardStart,
    ShardState,
    ShardStatus,
    ShardStop,
    StoreFile,
    TunnelDial,
)
from shoal.protocol.telemetry import GpuSample

PROTOCOL_VERSION = 17
"""Bumped on any incompatible change; a router refuses workers that speak another version.
17: several text models per worker: ``ModelInfo.slots``, ``resident_bytes``, ``load_seconds``,
``pinned``, ``loads``, ``evictions``, ``Register.model_budget_bytes`` and ``JobLoading``.
16: ``ShardLinks`` (a serving head's RPC round trips to each stage, as the head timed them).
15: ``ShardStart.store`` (the model store a split model's store id was found in, and its sha256).
14: ``HeartbeatInterval`` (the router paces an idle worker's heartbeats to its fleet's size).
13: ``Register.shard_ram_bytes`` (the RAM a worker offers split models, ``--shard-ram``).
12: ``Endpoint.RESPONSES``, ``MESSAGES`` and ``COUNT_TOKENS`` (OpenAI's Responses API and
Anthropic's Messages API, carried to llama-server as the client sent them).
11: ``Draining`` (a worker told to stop takes no new job and finishes those it runs).
10: ``JobFailed.context_needed`` (llama-server refused the prompt as longer than its context).
9: ``Register``/``Heartbeat.shard_devices`` (each GPU a split model may use), ``ShardStart.devices``
(the head's ``--device``, a stage's ``-d``), ``DevicePlacement.compute_bytes``.
8: ``Heartbeat.gpu_telemetry`` (utilization, memory, temperature and power per GPU) and
``Register.gpus_unused`` (a worker whose llama.cpp build drives none of its GPUs says so).
7: ``StateChanged.backend_url`` (a restarted llama-server listens on a new port).
6: ``Continuation.logprobs`` (a non-streamed answer's earlier log-probabilities).
5: chunks carry token ids (resuming answers); ``ShardStart`` names the stage's layers and the
pinned file, ``ShardStatus`` reports its seeding; ``CacheChanged`` and ``Heartbeat.cached``
report the prefixes a worker's slots hold (messages forbid unknown fields, so a v4 worker
could read none of these)."""

WS_PATH = "/ws/worker"

MAX_CACHED_BLOCKS = 8192
"""The most prefix hashes a worker reports (64 slots' worth of ``prefix.MAX_BLOCKS``)."""


# ---------------------------------------------------------------- shared vocabulary


class BackendState(enum.StrEnum):
    """What the worker's inference backend (llama-server or an attached server) is doing."""

    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    UNLOADED = "unloaded"
    """Stopped after an idle period to free memory; the next job loads it again (and waits)."""


class Endpoint(enum.StrEnum):
    """The OpenAI-compatible endpoints a job can target."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    IMAGE_GENERATIONS = "image_generations"
    """txt2img: the job body is a ``shoal.protocol.images.ImageJob``."""
    IMAGE_EDITS = "image_edits"
    """img2img: an ``ImageJob`` with ``init_image``."""
    RESPONSES = "responses"
    """OpenAI's Responses API; streams are typed events (``event:`` lines) without ``[DONE]``."""
    MESSAGES = "messages"
    """Anthropic's Messages API; streams are Anthropic's events, ending with ``message_stop``."""
    COUNT_TOKENS = "count_tokens"
    """Anthropic's token count of a Messages request (no generation)."""

    @property
    def path(self) -> str:
        return _ENDPOINT_PATHS[self]

    @property
    def is_image(self) -> bool:
        return self in IMAGE_ENDPOINTS

    @property
    def typed_events(self) -> bool:
        """Its streams are typed events that end with a last event of their own, not
        ``data: [DONE]`` (the Responses and Messages APIs)."""
        return self in (Endpoint.RESPONSES, Endpoint.MESSAGES)

    @property
    def streams_usage(self) -> bool:
        """Its streams report their usage when asked (``stream_options.include_usage``)."""
        return self in (Endpoint.CHAT, Endpoint.COMPLETIONS)


_ENDPOINT_PATHS = {
    Endpoint.CHAT: "/v1/chat/completions",
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.EMBEDDINGS: "/v1/embeddings",
    Endpoint.IMAGE_GENERATIONS: "/v1/images/generations",
    Endpoint.IMAGE_EDITS: "/v1/images/edits",
    Endpoint.RESPONSES: "/v1/responses",
    Endpoint.MESSAGES: "/v1/messages",
    Endpoint.COUNT_TOKENS: "/v1/messages/count_tokens",
}
IMAGE_ENDPOINTS = frozenset({Endpoint.IMAGE_GENERATIONS, Endpoint.IMAGE_EDITS})
TEXT_ENDPOINTS = frozenset(Endpoint) - IMAGE_ENDPOINTS
AGENT_ENDPOINTS = (Endpoint.RESPONSES, Endpoint.MESSAGES, Endpoint.COUNT_TOKENS)
"""The newer APIs a worker's own llama-server serves itself, beside chat and completions."""


class GpuInfo(Message):
    """One GPU of a worker, as its vendor tool reports it."""

    index: int
    name: str
    accelerator: str
    """``cuda``, ``rocm``, ``metal`` or ``vulkan``: the llama.cpp backend that drives it."""
    memory_total_bytes: int
    memory_free_bytes: int | None = None
    unified_memory: bool = False


class Hardware(Message):
    """A summary of the worker's machine, shown to operators and used for placement."""

    hostname: str
    os: str
    cpu_count: int
    ram_total_bytes: int
    ram_available_bytes: int
    cpu_model: str = ""
    cpu_features: tuple[str, ...] = ()
    accelerator: str = "cpu"
    gpus: tuple[GpuInfo, ...] = ()


class ModelInfo(Message):
    """A model the worker serves, under its public name."""

    name: ModelName
    endpoints: tuple[Endpoint, ...]
    context_length: int | None = None
    backend: str = "llama-server"
    state: BackendState | None = None
    """This model's own state, for a worker serving several that load and unload apart
    (image models, and text models of a worker serving several); None: the worker's state."""
    slots: int | None = Field(None, ge=1)
    """Jobs this model takes at once, for a worker serving several text models (each its own
    llama-server); None: ``Register.slots``."""
    resident_bytes: int | None = Field(None, ge=0)
    """The memory it holds when loaded: weights + KV + compute as llama-server reported them
    on its last load, else the fit estimate (None: not known, or not a model of ours)."""
    load_seconds: float | None = Field(None, ge=0)
    """How long its last load took, from start to ready (None: never loaded here)."""
    pinned: bool = False
    """Never evicted to make room for another model."""
    loads: int = Field(0, ge=0)
    """Loads since the worker started (the first included)."""
    evictions: int = Field(0, ge=0)
    """Times it was unloaded to make room for another model since the worker started."""


class ErrorBody(Message):
    """OpenAI-style error object."""

    message: str
    type: str
    code: str | int | None = None


# ---------------------------------------------------------------- worker -> router


class RunningJob(Message):
    """A job a reconnecting worker is still answering (or holds the answer of)."""

    job_id: JobId
    attempt: int = Field(ge=1)
    """``JobStart.attempt``: a job that was run again elsewhere since is not this one."""


class Register(Message):
    type: Literal["register"] = "register"
    protocol_version: int
    worker_id: WorkerId
    name: str
    hardware: Hardware
    models: tuple[ModelInfo, ...]
    slots: int = Field(ge=1)
    state: BackendState
    backend_url: str | None = None
    software: str = ""
    running: tuple[RunningJob, ...] = ()
    """Jobs started through a router this worker lost mid-answer: the new router adopts each
    (``JobResume``) or cancels it (``JobCancel``); the worker holds their output until then."""
    stage_memory_bytes: int | None = None
    """What a split model's stage here may hold: the free VRAM of the GPUs its
    ``ggml-rpc-server`` computes on (None: it computes on the CPU, in RAM)."""
    shard_devices: tuple[ShardDevice, ...] = ()
    """The GPUs split models' shards may use here, in llama.cpp's order, with their free
    memory (() : a CPU build, or none chosen); ``stage_memory_bytes`` is their sum."""
    no_shards: str | None = None
    """Why this worker cannot run parts of split models (None: it can)."""
    shard_ram_bytes: int | None = Field(None, ge=0)
    """The most RAM split models' shards may plan on here (``--shard-ram``; None: all that
    is free)."""
    model_budget_bytes: int | None = Field(None, ge=0)
    """The memory its resident text models may hold together (RAM and VRAM summed; None:
    it serves one text model, or none)."""
    gpus_unused: str | None = None
    """Why this worker's GPUs sit idle, with the fix: its llama.cpp build drives none of
    them (a CPU build on a GPU machine). None: it drives them, there are none, or the worker
    runs no llama.cpp."""


class Heartbeat(Message):
    type: Literal["heartbeat"] = "heartbeat"
    state: BackendState
    running_jobs: int
    ram_available_bytes: int
    gpu_free_bytes: tuple[int | None, ...] = ()
    """Free memory of each GPU in ``Hardware.gpus`` order (None where the tool cannot say)."""
    stage_memory_bytes: int | None = None
    """``Register.stage_memory_bytes``, now."""
    shard_devices: tuple[ShardDevice, ...] = ()
    """``Register.shard_devices``, now."""
    cached_blocks: tuple[int, ...] = Field((), max_length=MAX_CACHED_BLOCKS)
    """``CacheChanged.blocks``, now."""
    gpu_telemetry: tuple[GpuSample, ...] = ()
    """Each GPU's utilization, memory, temperature and power (``protocol.telemetry``)."""


class CacheChanged(Message):
    """What the worker's llama-server slots hold changed (a job took a slot, or
    llama-server restarted and holds nothing): the prefix blocks the router matches on."""

    type: Literal["cache"] = "cache"
    blocks: tuple[int, ...] = Field((), max_length=MAX_CACHED_BLOCKS)
    """The ``protocol.prefix.prefix_chain`` hashes some slot holds, sorted."""


class ModelsChanged(Message):
    """The worker's models changed (e.g. it learned the router's default model and loads it)."""

    type: Literal["models"] = "models"
    models: tuple[ModelInfo, ...]


class StateChanged(Message):
    type: Literal["state"] = "state"
    state: BackendState
    detail: str = ""
    backend_url: str | None = None
    """``Register.backend_url``, now: a restarted llama-server listens on a new port."""


class Draining(Message):
    """The worker is stopping (told to: SIGTERM): send it no new job; it finishes the jobs it
    runs, for at most ``timeout_s``, then closes (the router resumes any still running)."""

    type: Literal["draining"] = "draining"
    timeout_s: float = Field(ge=0)


class Chunk(Message):
    """One SSE ``data:`` payload of a streaming job, exactly as the backend produced it."""

    job_id: JobId
    data: str
    tokens: tuple[int, ...] | None = None
    """The ids of the tokens whose text this payload completes (what the stream sent up to
    here is exactly the text of every id sent so far; ``()``: none completed here). None:
    the worker does not know them, and the job cannot be resumed exactly from here on."""


class Chunks(Message):
    """Chunks of one or more jobs, batched into one frame when they arrive together."""

    type: Literal["chunks"] = "chunks"
    items: tuple[Chunk, ...]


class JobLoading(Message):
    """The job waits while its model loads on the worker (it was not resident): a streamed
    answer shows the client an SSE comment, ``: loading model=…``, until its first token."""

    type: Literal["loading"] = "loading"
    job_id: JobId
    model: ModelName


class JobResult(Message):
    """The whole answer of a non-streaming job."""

    type: Literal["result"] = "result"
    job_id: JobId
    body: str


class JobDone(Message):
    """A streaming job ended normally (the backend sent ``[DONE]``)."""

    type: Literal["done"] = "done"
    job_id: JobId


class JobFailed(Message):
    """The backend refused or broke the job. ``status`` is the HTTP status to give the client."""

    type: Literal["failed"] = "failed"
    job_id: JobId
    status: int
    error: ErrorBody
    started: bool = False
    """True when chunks were already sent: the router ends the stream with an error event."""
    retryable: bool = False
    """Nothing reached the backend's model (e.g. it was restarting): another worker may run it."""
    resumable: bool = False
    """The backend died mid-answer (not the request's fault): another worker may go on."""
    context_needed: int | None = Field(None, ge=1)
    """The backend refused the prompt as longer than its context per slot (llama-server's
    ``exceed_context_size_error``): the least context that could take it, in tokens (the
    prompt's as llama-server counted them, and one). A worker with that much may run it."""


WorkerMessage = Annotated[
    Register
    | Heartbeat
    | StateChanged
    | ModelsChanged
    | CacheChanged
    | Draining
    | Chunks
    | JobLoading
    | JobResult
    | JobDone
    | JobFailed
    | ShardStatus
    | ShardLinks,
    Field(discriminator="type"),
]

# ---------------------------------------------------------------- router -> worker


class Registered(Message):
    type: Literal["registered"] = "registered"
    worker_id: WorkerId
    heartbeat_interval_s: float
    router_version: str
    default_model: str | None = None
    """What a worker started without ``--model`` should serve."""


class HeartbeatInterval(Message):
    """Beat every ``seconds`` while idle from now on (the router paces its fleet's heartbeats:
    ``router/dispatch/heartbeats.py``); a worker running a job beats at ``Registered``'s
    interval (the base) whatever this says."""

    type: Literal["heartbeat_interval"] = "heartbeat_interval"
    seconds: float = Field(gt=0)


class RefusalCode(enum.StrEnum):
    BAD_KEY = "bad_key"
    PROTOCOL_VERSION = "protocol_version"
    BAD_REGISTRATION = "bad_registration"
    DUPLICATE_ID = "duplicate_id"


class Refused(Message):
    """Sent before the router closes a connection it will not serve. Not retried by workers."""

    type: Literal["refused"] = "refused"
    code: RefusalCode
    reason: str


class Continuation(Message):
    """What the client already has of an answer whose worker was lost: the worker going on
    asks its backend for the prompt followed by exactly these tokens, and makes what follows
    look like the rest of the same stream."""

    tokens: tuple[int, ...]
    """The ids of every token whose text the client got, in order."""
    id: str | None = None
    """The completion id the client saw (its chunks keep it)."""
    created: int | None = None
    logprobs: tuple[dict[str, Any], ...] = ()
    """A non-streamed answer that asked for log-probabilities: those of ``tokens`` (one
    entry each, as llama-server gave them), to put before the rest's."""


class JobStart(Message):
    type: Literal["job"] = "job"
    job_id: JobId
    model: ModelName
    endpoint: Endpoint
    stream: bool
    body: dict[str, Any]
    attempt: int = Field(1, ge=1)
    """Which run of the job this is (a job is run again when its first worker was lost)."""
    resume: Continuation | None = None
    """Go on with an answer another worker started: the client has its first part."""


class JobCancel(Message):
    type: Literal["cancel"] = "cancel"
    job_id: JobId


class JobResume(Message):
    """Go on with a job after reconnecting: send its chunks from number ``from_chunk`` on
    (counting from 0; the ones before reached the client), then the rest as it comes."""

    type: Literal["resume"] = "resume"
    job_id: JobId
    from_chunk: int = Field(ge=0)


class ModelControl(Message):
    """Load or unload one of the worker's models now (``POST /api/v1/models/load``)."""

    type: Literal["model_control"] = "model_control"
    model: ModelName
    action: Literal["load", "unload"]


RouterMessage = Annotated[
    Registered
    | Refused
    | HeartbeatInterval
    | JobStart
    | JobCancel
    | JobResume
    | ModelControl
    | ShardStart
    | ShardStop
    | TunnelDial,
    Field(discriminator="type"),
]

WORKER_MESSAGES: TypeAdapter[WorkerMessage] = TypeAdapter(WorkerMessage)
ROUTER_MESSAGES: TypeAdapter[RouterMessage] = TypeAdapter(RouterMessage)

# WebSocket close codes (4000-4999 are for applications).
CLOSE_REFUSED = 4001
CLOSE_PROTOCOL_ERROR = 4002
CLOSE_HEARTBEAT_TIMEOUT = 4003
CLOSE_SHUTDOWN = 4004


def encode(message: Message) -> str:
    return message.model_dump_json()


ChunkItem = tuple[JobId, str, tuple[int, ...] | None]
"""A chunk on the hot path: job id, data, token ids (``Chunk``)."""


def encode_chunks(items: Sequence[ChunkItem]) -> bytes:
    """The ``Chunks`` frame for ``(job_id, data, tokens)`` items, built without models.

    The hot path: one call per frame under load, ~10x cheaper than ``encode(Chunks(...))``
    and the same bytes (tests/protocol checks it).
    """
    return orjson.dumps(
        {
            "type": "chunks",
            "items": [
                {"job_id": j, "data": d} if t is None else {"job_id": j, "data": d, "tokens": t}
                for j, d, t in items
            ],
        }
    )


_CHUNKS_HEAD = b'{"type":"chunks","items":['
_CHUNK_KEYS = {"job_id", "data"}
_CHUNK_KEYS_TOKENS = {"job_id", "data", "tokens"}
_FRAME_KEYS = {"type", "items"}


def decode_chunk_items(frame: str | bytes) -> list[ChunkItem] | None:
    """The ``(job_id, data, tokens)`` items of a ``Chunks`` frame, or None for any other frame.

    The hot path's decoder: the same checks as the ``Chunks`` model (exact keys, strings),
    without building a model per chunk (~4x cheaper). Raises ``ValueError`` when a frame
    that starts like a chunks frame is malformed.
    """
    raw = frame.encode() if isinstance(frame, str) else frame
    if not raw.startswith(_CHUNKS_HEAD):
        return None
    obj = orjson.loads(raw)
    if not isinstance(obj, dict) or obj.keys() != _FRAME_KEYS or not isinstance(obj["items"], list):
        raise ValueError("malformed chunks frame")
    out: list[ChunkItem] = []
    for item in obj["items"]:
        if (
            not isinstance(item, dict)
            or (item.keys() != _CHUNK_KEYS and item.keys() != _CHUNK_KEYS_TOKENS)
            or not isinstance(item["job_id"], str)
            or not isinstance(item["data"], str)
        ):
            raise ValueError("malformed chunk in a chunks frame")
        out.append((JobId(item["job_id"]), item["data"], _token_ids(item.get("tokens"))))
    return out


def _token_ids(raw: object) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(type(t) is int for t in raw):
        raise ValueError("malformed token ids in a chunks frame")
    return tuple(raw)


def decode_worker_message(frame: str | bytes) -> WorkerMessage:
    """Parse one frame from a worker. Raises ``pydantic.ValidationError`` on a malformed frame."""
    return WORKER_MESSAGES.validate_json(frame)


def decode_router_message(frame: str | bytes) -> RouterMessage:
    return ROUTER_MESSAGES.validate_json(frame)


__all__ = [
    "PROTOCOL_VERSION",
    "WS_PATH",
    "BackendState",
    "CacheChanged",
    "Chunk",
    "Draining",
    "ChunkItem",
    "Chunks",
    "Continuation",
    "DevicePlacement",
    "Endpoint",
    "ErrorBody",
    "GpuInfo",
    "GpuSample",
    "IMAGE_ENDPOINTS",
    "AGENT_ENDPOINTS",
    "TEXT_ENDPOINTS",
    "Hardware",
    "Heartbeat",
    "HeartbeatInterval",
    "JobCancel",
    "JobDone",
    "JobFailed",
    "JobId",
    "JobResult",
    "JobStart",
    "LinkRtt",
    "Message",
    "ModelFile",
    "ModelInfo",
    "ModelName",
    "ModelsChanged",
    "Refused",
    "RefusalCode",
    "Register",
    "Registered",
    "RouterMessage",
    "RpcPeer",
    "ShardRole",
    "SeedReport",
    "ShardStart",
    "ShardState",
    "ShardDevice",
    "ShardLinks",
    "ShardStatus",
    "ShardStop",
    "StoreFile",
    "StateChanged",
    "TunnelDial",
    "WorkerId",
    "WorkerMessage",
    "decode_chunk_items",
    "decode_router_message",
    "decode_worker_message",
    "encode",
    "encode_chunks",
]
