"""Which device of which node holds which layers of one model: a pure planner, data in and
decision out.

A node (a worker) offers **devices**, in the order llama.cpp uses them: first its CPU (its
free RAM), then each GPU its llama.cpp build drives. The nodes' devices, node after node,
form one sequence, and the planner splits the model's repeating layers (``blk.N``) into one
contiguous range per device in that order, the way llama.cpp's layer split does: on the head
the layers that ``-ngl`` leaves behind stay on its CPU and come first, then its own GPUs in
``--device`` order, then the stages' devices (``RPC0``, ``RPC1``...) in ``--rpc`` order.
A device's memory need is the weights of its layers, their KV cache for ``ctx`` tokens and
one compute buffer; the last device that holds layers also holds the output norm and
lm-head (``tail_bytes``), and the token embedding (``head_bytes``) stays in the RAM of the
node that holds the first layer, whichever of its devices holds that layer (llama.cpp never
offloads the input layer). Each device may use ``free_bytes * (1 - headroom)``.

A node with GPUs computes on them: its RAM is a **spill** device that takes layers only when
the model does not fit otherwise, and then as few as it can (a layer in RAM runs on the CPU,
many times slower). A node without GPUs computes on its CPU: its RAM is an ordinary device.

Nodes that would get no layers are left out of the plan. The plan's first shard is the head
(run ``llama-server`` there: it keeps the token embedding) and its last shard the tail. A
head that is too small for even one layer plus the token embedding is therefore dropped and
the next node becomes the head; the caller starts ``llama-server`` on
``plan.shards[0].node_id``.

Among all the assignments that fit, the planner picks the best one exactly (a dynamic
program over split points, not a greedy fill), so it never answers :class:`NoFit` when
some contiguous assignment in the given device order fits. First it puts as few layers on
spill devices as it can; then, among the other devices:

* ``PROPORTIONAL`` minimises the squared distance between each device's layer count and its
  share of the layers by free memory, ``n_layers * free / total_free``;
* ``BALANCED`` minimises the largest layer count on any device, then the squared layer
  counts (so the layers spread as evenly as the capacities allow).

Ties go to the assignment with its layers nearer the head. The search itself is
``placement_search``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Literal

from shoal.router.deployments import placement_search as search

Role = Literal["head", "stage", "tail"]
CPU = "CPU"
"""The device name of a node's CPU and RAM, as llama.cpp and ``ggml-rpc-server -d`` name it."""


def _check_sizes(what: str, values: Sequence[int]) -> None:
    for value in values:
        if value < 0:
            raise ValueError(f"{what} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """The memory one model needs, per layer; a caller builds it from GGUF metadata.

    ``kv_bytes_per_token`` is, per layer, the KV cache bytes one token takes for the cache
    type in use: ``(n_embd_k_gqa + n_embd_v_gqa) * bytes(type)``.
    """

    n_layers: int
    layer_weight_bytes: tuple[int, ...]
    """Bytes of each repeating layer's tensors (``blk.N.*``), one entry per layer."""
    kv_bytes_per_token: tuple[int, ...]
    """KV cache bytes per token of each layer, one entry per layer."""
    head_bytes: int
    """The token embedding (``token_embd``): always in the head node's RAM."""
    tail_bytes: int
    """The output norm and lm-head (``output_norm``, ``output``): on the last device."""
    compute_bytes: int
    """The compute buffer allowance of each device that holds layers."""

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        for name, per_layer in (
            ("layer_weight_bytes", self.layer_weight_bytes),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
        ):
            if len(per_layer) != self.n_layers:
                raise ValueError(
                    f"{name} has {len(per_layer)} entries, expected one per layer ({self.n_layers})"
                )
            _check_sizes(name, per_layer)
        _check_sizes("head_bytes", (self.head_bytes,))
        _check_sizes("tail_bytes", (self.tail_bytes,))
        _check_sizes("compute_bytes", (self.compute_bytes,))


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of a node, by llama.cpp's name for it (``CUDA0``, ``Vulkan1``, ``ROCm0``,
    ``MTL0``: what ``llama-server --list-devices`` prints), with its free memory."""

    name: str
    free_bytes: int

    def __post_init__(self) -> None:
        if not self.name or self.name.upper() == CPU or "," in self.name:
            raise ValueError(f"{self.name!r} is not a GPU's device name")
        _check_sizes(f"free_bytes of GPU {self.name!r}", (self.free_bytes,))


@dataclass(frozen=True, slots=True)
class Node:
    """A worker: its free RAM (its CPU's place for layers, and where the head keeps the token
    embedding) and the GPUs its llama.cpp build drives, in the order it uses them."""

    id: str
    free_bytes: int
    gpus: tuple[Gpu, ...] = ()

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("a node needs a non-empty id")
        _check_sizes(f"free_bytes of node {self.id!r}", (self.free_bytes,))
        names = [g.name for g in self.gpus]
        if len(set(names)) != len(names):
            raise ValueError(f"node {self.id!r} lists a GPU twice: {', '.join(names)}")


class Strategy(enum.StrEnum):
    """How layers are shared out among the devices that can hold them."""

    PROPORTIONAL = "proportional"
    """Layers in proportion to each device's free memory."""
    BALANCED = "balanced"
    """As equal a number of layers on each device as memory allows."""


@dataclass(frozen=True, slots=True)
class Held:
    """Layers ``first_layer..last_layer`` (both inclusive; none when ``last_layer <
    first_layer``) and what they take of the memory that holds them.

    ``weight_bytes`` counts the layers' weights plus what else of the model lies there (the
    head's or tail's tensors); ``total_bytes`` is ``weight_bytes + kv_bytes + compute_bytes``
    and ``margin_bytes`` is ``free_bytes - total_bytes``, where ``free_bytes`` is what that
    memory offers.
    """

    first_layer: int
    last_layer: int
    weight_bytes: int
    kv_bytes: int
    compute_bytes: int
    total_bytes: int
    free_bytes: int
    margin_bytes: int

    @property
    def n_layers(self) -> int:
        return max(0, self.last_layer - self.first_layer + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceShare(Held):
    """What one device of a shard holds, on that device alone (no layers: the head's RAM
    holding only the token embedding)."""

    device: str
    """``CPU`` (the node's RAM) or a GPU's name (``CUDA0``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard(Held):
    """One node's part of a plan, on the devices in ``devices`` together.

    ``role`` is ``"head"`` for the first shard, ``"tail"`` for the last and ``"stage"`` in
    between. A plan with a single shard has only a ``"head"``, which then holds everything,
    the tail bytes included. ``weight_bytes`` counts the layers' weights plus
    ``head_bytes`` on the head and ``tail_bytes`` on the last shard.
    """

    node_id: str
    role: Role
    devices: tuple[DeviceShare, ...] = ()
    """The devices that hold something, in llama.cpp's order (empty: all on its CPU)."""

    @property
    def holders(self) -> tuple[DeviceShare, ...]:
        """The devices that hold layers, in order (a shard planned without devices: its CPU)."""
        if not self.devices:
            return (_all_on_cpu(self),)
        return tuple(d for d in self.devices if d.n_layers)


def _all_on_cpu(s: Shard) -> DeviceShare:
    held = {f.name: getattr(s, f.name) for f in fields(Held)}
    return DeviceShare(device=CPU, **held)


@dataclass(frozen=True, slots=True)
class Plan:
    """Where every layer of the model goes, for a context of ``ctx`` tokens."""

    shards: tuple[Shard, ...]
    ctx: int
    strategy: Strategy

    @property
    def layer_counts(self) -> tuple[int, ...]:
        """The number of repeating layers on each shard, in order."""
        return tuple(s.n_layers for s in self.shards)

    @property
    def tensor_split(self) -> tuple[int, ...]:
        """The layer counts in shard order, with the output layer counted as one more layer
        on the last shard: what ``--tensor-split`` would be with every shard one device and
        ``-ngl all`` (llama.cpp splits ``n_layers + 1`` layers, the output being layer
        ``n_layers``, at the cumulative proportions, so plain layer counts would shift layers
        towards the head). ``launch.head_launch`` gives the head's real arguments, device by
        device.
        """
        counts = list(self.layer_counts)
        counts[-1] += 1
        return tuple(counts)

    def layout(self, names: Mapping[str, str] | None = None) -> list[str]:
        """One line per device that holds something, in order: ``box1/CUDA0 layers 0-26``,
        ``box1/CPU token embedding`` (``names``: node id -> the name to show)."""
        lines = []
        for s in self.shards:
            node = (names or {}).get(s.node_id) or s.node_id
            for d in s.devices or s.holders:
                held = f"layers {d.first_layer}-{d.last_layer}" if d.n_layers else ""
                if s.role == "head" and d.device == CPU:
                    held = f"{held} + token embedding" if held else "token embedding"
                lines.append(f"{node}/{d.device} {held}")
        return lines

    def to_json(self) -> str:
        return json.dumps(
            {
                "ctx": self.ctx,
                "strategy": self.strategy.value,
                "tensor_split": list(self.tensor_split),
                "shards": [asdict(s) for s in self.shards],
            }
        )


@dataclass(frozen=True, slots=True)
class NoFit:
    """The model does not fit the nodes at this ctx, with what is missing and what to do.

    ``shortfall_bytes`` is the least total overflow over every assignment of layers to the
    devices: the memory that would have to be found on the devices where it is short. It is
    at least ``needed_bytes - available_bytes``, and more when no whole layer fits into the
    memory that is left over. ``needed_bytes`` is what that least-overflow assignment needs
    in total and ``available_bytes`` what all the devices may use after the headroom.
    """

    needed_bytes: int
    available_bytes: int
    shortfall_bytes: int
    reason: str


def _check_request(nodes: Sequence[Node], ctx: int, headroom: float) -> None:
    if not nodes:
        raise ValueError("no nodes to place the model on")
    ids = [node.id for node in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"node ids must be unique, got {ids}")
    if ctx < 1:
        raise ValueError(f"ctx must be >= 1, got {ctx}")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")


def plan(
    profile: ModelProfile,
    nodes: Sequence[Node],
    ctx: int,
    strategy: Strategy = Strategy.PROPORTIONAL,
    *,
    headroom: float = 0.10,
) -> Plan | NoFit:
    """Split the model's layers over the devices of ``nodes`` (in that order) for ``ctx``
    tokens of KV.

    ``ctx`` is the number of KV cells llama-server allocates (its ``-c``, which it rounds
    up to a multiple of 256). Every device's total stays within
    ``free_bytes * (1 - headroom)``. Nodes that would hold no layers are left out of the
    plan. Returns :class:`NoFit` when no contiguous assignment in this order fits.
    Raises ValueError for nonsense input: no nodes, duplicate ids, ``ctx < 1``, or a
    headroom outside ``[0, 1)``.
    """
    _check_request(nodes, ctx, headroom)
    layout = search.Layout.build(profile, nodes, ctx, headroom)
    best = search.balanced if strategy is Strategy.BALANCED else search.proportional
    cuts = best(layout)
    if cuts is None:
        return _no_fit(layout, len(nodes), headroom)
    return _plan_from(layout, nodes, cuts, strategy)


# --- building the answer ----------------------------------------------------------------


def _role(index: int, count: int) -> Role:
    if index == 0:
        return "head"
    return "tail" if index == count - 1 else "stage"


def _share(layout: search.Layout, j: int, p: int, q: int) -> DeviceShare:
    """Place ``j`` holding ``[p, q)``; an empty range on the head's RAM holds the embedding."""
    weights = layout.weights(j, p, q)
    if p == q:
        weights = layout.head
    kv, compute = layout.kv(p, q), layout.compute_for(p, q)
    place = layout.places[j]
    total = weights + kv + compute
    return DeviceShare(
        device=place.device,
        first_layer=p,
        last_layer=q - 1,
        weight_bytes=weights,
        kv_bytes=kv,
        compute_bytes=compute,
        total_bytes=total,
        free_bytes=place.free,
        margin_bytes=place.free - total,
    )


def _node_shares(layout: search.Layout, cuts: search.Cuts) -> dict[int, list[DeviceShare]]:
    """Per node that holds layers, what each of its devices holds, in order."""
    shares: dict[int, list[DeviceShare]] = {}
    for j, p, q in search.held(cuts):
        place = layout.places[j]
        mine = shares.setdefault(place.node, [])
        if layout.embedding_in_ram(j, p, q):  # a GPU holds layer 0: the embedding in RAM
            mine.append(_share(layout, place.host, 0, 0))
        mine.append(_share(layout, j, p, q))
    return shares


def _plan_from(
    layout: search.Layout,
    nodes: Sequence[Node],
    cuts: search.Cuts,
    strategy: Strategy,
) -> Plan:
    by_node = _node_shares(layout, cuts)
    shards: list[Shard] = []
    for index, (i, devices) in enumerate(by_node.items()):
        held = [d for d in devices if d.n_layers]
        free = sum(d.free_bytes for d in devices)
        total = sum(d.total_bytes for d in devices)
        shards.append(
            Shard(
                node_id=nodes[i].id,
                role=_role(index, len(by_node)),
                first_layer=held[0].first_layer,
                last_layer=held[-1].last_layer,
                weight_bytes=sum(d.weight_bytes for d in devices),
                kv_bytes=sum(d.kv_bytes for d in devices),
                compute_bytes=sum(d.compute_bytes for d in devices),
                total_bytes=total,
                free_bytes=free,
                margin_bytes=free - total,
                devices=tuple(devices),
            )
        )
    return Plan(shards=tuple(shards), ctx=layout.ctx, strategy=strategy)


_MIB = 1024 * 1024
_GIB = 1024 * _MIB


def _format_bytes(n: int) -> str:
    """``n`` bytes in GiB from 1 GiB up, else in MiB from 1 MiB up, else in bytes."""
    if n >= _GIB:
        return f"{n / _GIB:.2f} GiB"
    if n >= _MIB:
        return f"{n / _MIB:.1f} MiB"
    return f"{n} B"


def _no_fit(layout: search.Layout, n_nodes: int, headroom: float) -> NoFit:
    """Explain the failure by the assignment that overflows the devices the least."""
    least = search.least_overflow(layout)
    needed, available, shortfall = least.needed, least.available, least.shortfall
    devices = len(search.held(least.cuts))
    kv = layout.kv(0, layout.n)
    reason = (
        f"The model does not fit at ctx {layout.ctx}: it needs {_format_bytes(needed)} "
        f"({_format_bytes(least.weights)} weights, {_format_bytes(kv)} KV cache, "
        f"{_format_bytes(layout.compute * devices)} compute buffers on {devices} "
        f"device(s)) but the {n_nodes} node(s) can use {_format_bytes(available)} after "
        f"{headroom:.0%} headroom: {_format_bytes(shortfall)} short."
    )
    if shortfall > needed - available:
        reason += " Layers are not split across devices, so memory left over that is too"
        reason += " small for a whole layer does not help."
    reason += (
        f" Add a worker (or free about {_format_bytes(shortfall)} on these), lower ctx "
        f"(the KV cache takes {_format_bytes(kv)} at ctx {layout.ctx}), "
        "or use a smaller quantization."
    )
    return NoFit(
        needed_bytes=needed, available_bytes=available, shortfall_bytes=shortfall, reason=reason
    )
