"""From a plan to the shards' command lines, and back from where llama-server put the layers
(pure).

**Stages.** Each stage's ``ggml-rpc-server`` serves exactly the devices the plan gives it
layers on, in the plan's order (``-d CPU,CUDA0``: its RAM, when the model spills there,
comes first). The head sees them as RPC devices numbered across the stages in ``--rpc``
order: the first stage's devices are ``RPC0``, ``RPC1``..., the next stage's follow
(``ggml_backend_rpc_add_server`` numbers every server's devices with one counter).

**The head.** llama.cpp keeps the first ``n_layers + 1 - ngl`` layers on the head's CPU (the
output layer counts as one more, layer ``n_layers``) and offloads the rest to the devices of
``--device`` in that order, at the cumulative ``--tensor-split`` proportions: device ``k``
takes layer ``j`` (counted from the first offloaded one) while ``j / ngl`` is below its
cumulative share. So ``-ngl`` is every layer not on the head's CPU plus the output layer,
``--device`` names the head's own GPUs that hold layers and then every stage device, and
``--tensor-split`` their layer counts, with the output layer added to the last one: every
boundary lands exactly on the plan. A GPU of the head that the plan gives nothing is left
out of ``--device``, so it takes nothing; with nothing offloaded, ``--device none``.

After loading, llama-server logs each device's KV buffer, which is proportional to the
layers it holds: ``placed_layers`` turns those bytes back into layer counts to compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.deployments.placement import CPU, Plan

RPC_PREFIX = "RPC"
MAX_DEVICES = 15
"""The most ``--tensor-split`` entries llama-server takes (``common/arg.cpp``: fewer than
``llama_max_devices()``, 16, in the pinned build)."""


@dataclass(frozen=True, slots=True)
class HeadLaunch:
    n_gpu_layers: int
    devices: tuple[str, ...]
    """``--device``: the head's own GPUs that hold layers, then every stage device as
    ``RPC<k>``, in the plan's order (empty: nothing offloaded)."""
    tensor_split: tuple[int, ...]
    """One entry per device of ``devices``."""


def head_launch(plan: Plan) -> HeadLaunch:
    """llama-server's ``-ngl``, ``--device`` and ``--tensor-split`` for ``plan``'s head."""
    head, stages = plan.shards[0], plan.shards[1:]
    devices: list[str] = []
    split: list[int] = []
    for d in head.holders:
        if d.device != CPU:
            devices.append(d.device)
            split.append(d.n_layers)
    for rpc, d in enumerate(d for stage in stages for d in stage.holders):
        devices.append(f"{RPC_PREFIX}{rpc}")
        split.append(d.n_layers)
    if not devices:
        return HeadLaunch(n_gpu_layers=0, devices=(), tensor_split=())
    split[-1] += 1  # the output layer goes with the last device
    return HeadLaunch(n_gpu_layers=sum(split), devices=tuple(devices), tensor_split=tuple(split))


def too_many_devices(plan: Plan) -> str | None:
    """Why llama-server cannot take ``plan``'s devices (None: it can)."""
    count = len(head_launch(plan).devices)
    if count <= MAX_DEVICES:
        return None
    return (
        f"the plan offloads to {count} devices, but llama-server takes at most {MAX_DEVICES}: "
        "name fewer workers, or fewer GPUs on them (--gpu-devices)"
    )


def stage_devices(plan: Plan) -> tuple[tuple[str, ...], ...]:
    """Per stage, in order: the devices its ``ggml-rpc-server`` serves (``-d``)."""
    return tuple(tuple(d.device for d in stage.holders) for stage in plan.shards[1:])


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds the layers of one device of the head's ``--device`` list, or its CPU."""

    worker: str
    device: str
    """The worker's own name for it: ``CPU``, ``CUDA0``..."""
    layers: tuple[int, int] | None
    """The plan's first and last layer there (None: the token embedding only)."""


def holders(plan: Plan) -> dict[str, Holder]:
    """The head's names for devices (``CPU``, its GPUs, ``RPC<k>``) -> whose device holds
    which layers, as planned; what the load log reports is matched against it."""
    out: dict[str, Holder] = {}
    head = plan.shards[0]
    for d in head.devices or head.holders:
        layers = (d.first_layer, d.last_layer) if d.n_layers else None
        out[d.device] = Holder(head.node_id, d.device, layers)
    rpc = 0
    for stage in plan.shards[1:]:
        for d in stage.holders:
            out[f"{RPC_PREFIX}{rpc}"] = Holder(
                stage.node_id, d.device, (d.first_layer, d.last_layer)
            )
            rpc += 1
    return out


def placed_layers(kv_bytes: Sequence[int], kv_bytes_per_layer: int) -> tuple[int, ...]:
    """Layers per device from the KV bytes each holds (every layer's KV the same size)."""
    if kv_bytes_per_layer <= 0:
        raise ValueError("kv_bytes_per_layer must be positive")
    return tuple(round(b / kv_bytes_per_layer) for b in kv_bytes)
