"""The text models a worker serving several will run: one ``Plan`` per model spec, decided
before anything starts (each model resolved, its own alias, context, slots, llama-server
arguments, idle unload and log file), whether it is pinned and preloaded, and its first-load
estimate against the worker's budget.

The specs come from ``--models-file``, else from ``--model`` given several times (or
comma-separated): none of those is pinned. A spec that does not say whether it is preloaded
is when it is the first one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shoal.hardware.detect import parse_gpu_devices
from shoal.hardware.profile import MachineProfile
from shoal.models.residency import Footprint
from shoal.paths import kv_saves_dir
from shoal.units import GIB
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.plan import Plan, WorkerConfigError, plan
from shoal.worker.text.residency.budget import estimate_file, model_budget
from shoal.worker.text.residency.kv_saves import SlotSaves
from shoal.worker.text.residency.models_file import (
    ModelsFileError,
    ModelSpec,
    check_names,
    load_models_file,
)


@dataclass(frozen=True)
class PlannedModel:
    """One text model of several: its plan, and how the worker keeps it."""

    plan: Plan
    estimate: Footprint
    """What it needs before its first load measures it (``budget.estimate``)."""
    pinned: bool = False
    """Never evicted."""
    preload: bool = False
    """Loaded at start (in the given order; one that does not fit is logged)."""


def model_specs(settings: WorkerSettings) -> tuple[ModelSpec, ...]:
    """What ``--models-file`` lists, else one spec per ``--model``."""
    try:
        if settings.models_file is not None:
            if settings.model:
                raise WorkerConfigError(
                    "give the text models either with --model or in --models-file, not both"
                )
            return load_models_file(settings.models_file)
        specs = tuple(ModelSpec(model=m) for m in settings.models)
        check_names(specs, "--model")
    except ModelsFileError as exc:
        raise WorkerConfigError(str(exc)) from None
    return specs


def budget_of(settings: WorkerSettings, machine: MachineProfile) -> Footprint:
    """What the text models may hold together here (``budget.model_budget``)."""
    try:
        gpus = None if settings.gpu_devices is None else parse_gpu_devices(settings.gpu_devices)
    except ValueError as exc:
        raise WorkerConfigError(str(exc)) from None  # its message names the flag
    cap = None if settings.memory_budget is None else int(settings.memory_budget * 2**30)
    return model_budget(machine, gpus, cap)


def _refuse_conflicts(settings: WorkerSettings) -> None:
    for given, flag in (
        (settings.backend_url, "--backend-url"),
        (settings.model_path, "--model-path"),
        (settings.model_alias, "--model-alias"),
    ):
        if given is not None:
            raise WorkerConfigError(
                f"{flag} serves one text model; several (--models-file, or --model given "
                "more than once) each name theirs: drop " + flag
            )


def spec_settings(settings: WorkerSettings, spec: ModelSpec) -> WorkerSettings:
    """``settings`` as a worker of ``spec``'s model alone would have them."""
    update: dict[str, object] = {"model": spec.model, "model_alias": spec.alias}
    for field in ("ctx_size", "slots", "llama_server_args", "idle_unload", "quantization"):
        value = getattr(spec, field)
        if value is not None:
            update[field] = value
    return settings.model_copy(update=update)


MEASURE_ARGS = ("-lv", "4")
"""llama-server logs its buffers' sizes (what a model holds) only at this verbosity."""
NO_PROMPT_CACHE_ARGS = ("--cache-ram", "0")
"""llama-server's host-memory prompt cache (8 GiB at most by default) would grow each model
past what it measured on load; Shoal's pinned jobs never read it (``text/slots.py``), and a
model's slots are kept across an eviction by ``kv_saves.py`` instead."""


def measured(the_plan: Plan) -> Plan:
    """``the_plan`` as a model of several runs it: llama-server logs its buffers (unless its
    arguments set a verbosity) and keeps no prompt cache in RAM (unless they set one)."""
    llama = the_plan.llama
    if llama is None:
        return the_plan
    given = set(llama.extra_args)
    extra = llama.extra_args
    if not {"-lv", "--log-verbosity", "--verbosity"} & given:
        extra = (*extra, *MEASURE_ARGS)
    if not {"--cache-ram", "-cram"} & given:
        extra = (*extra, *NO_PROMPT_CACHE_ARGS)
    return replace(the_plan, llama=replace(llama, extra_args=extra))


def slot_saves(settings: WorkerSettings) -> SlotSaves:
    """Where the models' slots are saved before an eviction, and how much of them is kept
    (``--kv-save-limit``; 0: none)."""
    return SlotSaves(kv_saves_dir(settings.cache_dir), int(settings.kv_save_limit * GIB))


def one_of_several(the_plan: Plan, saves: SlotSaves) -> Plan:
    """``measured``, its slots saved where ``saves`` keeps this model's (a folder named by
    its final command line, so a cache only goes back into the model that made it)."""
    ran = measured(the_plan)
    if ran.llama is None:
        return ran
    return replace(ran, llama=replace(ran.llama, slot_save_path=saves.folder(ran.llama)))


def _planned(the_plan: Plan, spec: ModelSpec, index: int, budget: Footprint) -> PlannedModel:
    llama = the_plan.llama
    assert llama is not None  # several models: never an attached server
    need = estimate_file(llama.model_path, llama.ctx_size * llama.slots, budget)
    return PlannedModel(the_plan, need, spec.pinned, preloaded(spec, index))


def preloaded(spec: ModelSpec, index: int) -> bool:
    """Whether the ``index``-th model (from 0) loads at start: as its spec says, else only the
    first."""
    return spec.preload if spec.preload is not None else index == 0


def plan_models(
    settings: WorkerSettings, path_env: str | None, machine: MachineProfile
) -> tuple[PlannedModel, ...]:
    """One plan per text model (downloading what is missing). Blocking."""
    _refuse_conflicts(settings)
    specs = model_specs(settings)
    budget = budget_of(settings, machine)
    saves = slot_saves(settings)
    planned = tuple(
        _planned(
            one_of_several(plan(spec_settings(settings, s), path_env, machine), saves), s, i, budget
        )
        for i, s in enumerate(specs)
    )
    names = [p.plan.model.name for p in planned]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise WorkerConfigError(
            f"text model name(s) {', '.join(twice)} given twice: give each copy its own alias"
        )
    return planned
