"""A model's planner profile from its GGUF file, and the plans made from it.

The router plans on its own copy of the GGUF (the file it lists, or the model store's):
``model_profile`` reads the file once per (path, mtime, size) and derives per-layer weights
and KV bytes; ``plan_for`` turns it into a plan over nodes at a context size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.controller.placement import ModelProfile, Node, NoFit, Plan, Strategy, plan
from shoal.models.gguf_info import KV_CTX_PAD, GGUFInfo, inspect, kv_bytes_per_token

COMPUTE_MARGIN = 0.10
COMPUTE_FLOOR_BYTES = 64 * 1024 * 1024


@functools.lru_cache(maxsize=16)
def _inspect_cached(path: Path, mtime_ns: int, size: int) -> GGUFInfo:
    return inspect(path)


def gguf_info(path: Path) -> GGUFInfo:
    """``inspect(path)``, cached while the file does not change. Blocking."""
    stat = path.stat()
    return _inspect_cached(path, stat.st_mtime_ns, stat.st_size)


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
        compute_bytes=math.ceil(COMPUTE_MARGIN * (weights + kv_total)) + COMPUTE_FLOOR_BYTES,
    )


def kv_cells(ctx: int) -> int:
    """The KV cells llama-server allocates for ``-c ctx`` (it pads to a multiple of 256)."""
    return math.ceil(ctx / KV_CTX_PAD) * KV_CTX_PAD


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
