"""Whether a new plan is worth a rebalance of a serving deployment (pure: data in, decision out).

A worker that joins may make a serving deployment's plan better. Moving a serving deployment
costs a drain and a redeploy (its shards stop, the new ones load), so only a plan that is
better in a way that matters is worth it. ``better`` compares the plan the deployment serves
with a candidate planned over the workers there are now, in this order:

1. **fewer layers in the RAM of a worker that has GPUs** (the planner's first goal: a layer
   spilled to RAM runs on the CPU, many times slower); more such layers is never better;
2. **no worker over its budget**: the serving plan puts more on some worker than that worker
   offers now (its memory shrank since), and the candidate puts no worker over;
3. **a worker freed from more than its share**: the highest share of a worker's memory the
   plan uses drops by at least ``MIN_GAIN`` (0.10: from 90 % to 80 % or lower).

Anything else (the same layout, a gain below ``MIN_GAIN``, a candidate that does not fit) is
not worth moving for. Memory is judged against what each worker offers now, with what the
serving deployment itself holds there given back (``reclaimed``): a worker that serves a shard
reports that shard's memory as used, and would have it again after the switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from shoal.router.deployments.placement import CPU, Gpu, Node, NoFit, Plan

MIN_GAIN = 0.10
"""The least drop of the highest memory share that is worth a rebalance."""


@dataclass(frozen=True, slots=True)
class Quality:
    """What ``better`` compares of one plan, against the memory the nodes offer now."""

    spilled_layers: int
    """Layers in the RAM of a node that has GPUs."""
    over_budget: tuple[str, ...]
    """Nodes the plan puts more on than they offer now (ids, in shard order)."""
    peak_share: float
    """The highest share of one node's memory (RAM and GPUs together) the plan uses."""


def quality(plan: Plan, nodes: Sequence[Node]) -> Quality:
    """``plan`` judged against ``nodes`` as they are now (a node missing: offers nothing)."""
    by_id = {n.id: n for n in nodes}
    spilled, over, shares = 0, [], [0.0]
    for s in plan.shards:
        node = by_id.get(s.node_id)
        offered = _offered(node)
        if node is not None and node.gpus:
            spilled += sum(d.n_layers for d in s.holders if d.device == CPU)
        if s.total_bytes > offered:
            over.append(s.node_id)
        shares.append(s.total_bytes / offered if offered else float("inf"))
    return Quality(spilled_layers=spilled, over_budget=tuple(over), peak_share=max(shares))


def better(current: Quality, candidate: Plan | NoFit, nodes: Sequence[Node]) -> str | None:
    """Why ``candidate`` (planned over ``nodes``) is worth moving the deployment to, or None.

    ``current`` is the serving plan's ``quality`` against the same ``nodes``."""
    if isinstance(candidate, NoFit):
        return None
    new = quality(candidate, nodes)
    if new.spilled_layers != current.spilled_layers:
        if new.spilled_layers > current.spilled_layers:
            return None
        return (
            f"{current.spilled_layers - new.spilled_layers} fewer layer(s) in the RAM of a "
            f"GPU worker ({current.spilled_layers} -> {new.spilled_layers})"
        )
    if new.over_budget:
        return None
    if current.over_budget:
        return f"no worker over its memory (now over: {', '.join(current.over_budget)})"
    if new.peak_share <= current.peak_share - MIN_GAIN:
        return (
            f"the fullest worker's share of its memory drops from {current.peak_share:.0%} "
            f"to {new.peak_share:.0%}"
        )
    return None


def layout(plan: Plan) -> tuple[tuple[str, str, int, int], ...]:
    """Which device of which worker holds which layers: a rebalance moves only when it changes."""
    return tuple(
        (s.node_id, d.device, d.first_layer, d.last_layer) for s in plan.shards for d in s.holders
    )


def reclaimed(nodes: Sequence[Node], serving: Plan) -> list[Node]:
    """``nodes`` with the memory ``serving`` holds on them given back, device by device, up
    to what the device offered when ``serving`` was planned (a shard's own memory shows as
    used while it runs; anything else that took memory since stays taken)."""
    held: dict[tuple[str, str], tuple[int, int]] = {}
    for s in serving.shards:
        for d in s.devices or s.holders:
            held[(s.node_id, d.device)] = (d.total_bytes, d.free_bytes)

    def back(node_id: str, device: str, free: int) -> int:
        total, planned_free = held.get((node_id, device), (0, 0))
        return max(free, min(free + total, planned_free))

    return [
        replace(
            n,
            free_bytes=back(n.id, CPU, n.free_bytes),
            gpus=tuple(Gpu(g.name, back(n.id, g.name, g.free_bytes)) for g in n.gpus),
        )
        for n in nodes
    ]


def _offered(node: Node | None) -> int:
    if node is None:
        return 0
    return node.free_bytes + sum(g.free_bytes for g in node.gpus)
