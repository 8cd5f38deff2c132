"""A model's planner profile from its GGUF's structure, and the plans made from it (pure).

The router plans on a GGUF's structure (``sources``: its own copy, or a model store's header
read by HTTP ``Range``): ``profile_of`` derives per-layer weights and KV
bytes from it; ``plan_for`` turns it into a plan over nodes at a context size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.models.gguf_info import GGUFInfo, kv_bytes_per_token, kv_cells, with_compute
from shoal.router.deployments.placement import ModelProfile, Node, NoFit, Plan, Strategy, plan


def profile_of(info: GGUFInfo, ctx: int) -> ModelProfile:
    """The planner's view of a model: per-layer weights and KV, head and tail, compute."""
    layers = range(info.n_layers)
    weights = sum(layer.nbytes for layer in info.layers)
    kv_total = kv_bytes_per_token(info, layers) * ctx
    return ModelProfile(
        n_layers=info.n_layers,
        layer_weight_bytes=tuple(layer.nbytes for layer in info.layers),
        kv_bytes_per_token=tuple(kv_bytes_per_token(info, range(i, i + 1)) for i in layers),
        head_bytes=info.head_bytes,
        tail_bytes=info.tail_bytes,
        compute_bytes=with_compute(weights, kv_total).compute_bytes,
    )


@dataclass(frozen=True, slots=True)
class Planned:
    info: GGUFInfo
    cells: int
    result: Plan | NoFit

    def kv_bytes_per_layer(self) -> int:
        """One layer's KV cache at this context (the first layer's: all are alike here)."""
        return kv_bytes_per_token(self.info, range(0, 1)) * self.cells


def plan_for(info: GGUFInfo, nodes: Sequence[Node], ctx: int, strategy: Strategy) -> Planned:
    cells = kv_cells(ctx)
    return Planned(info, cells, plan(profile_of(info, cells), nodes, cells, strategy))
