"""Several text models: which specs a worker's flags give, each model's settings, the worker's
state from its models', and the flags that cannot go with several models. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.cli.main import build_parser
from shoal.protocol.messages import BackendState
from shoal.settings import settings_from_args
from shoal.worker.settings import WorkerSettings
from shoal.worker.text.plan import WorkerConfigError, plans_text
from shoal.worker.text.residency.models import worker_state
from shoal.worker.text.residency.models_file import ModelSpec
from shoal.worker.text.residency.planned import (
    _refuse_conflicts,
    model_specs,
    preloaded,
    spec_settings,
)

R, U, L, S, F = (
    BackendState.READY,
    BackendState.UNLOADED,
    BackendState.LOADING,
    BackendState.RESTARTING,
    BackendState.FAILED,
)


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ((R,), R),
        ((U, R, F), R),
        ((U, L), U),  # a job for the unloaded one loads it: the router may send it
        ((U, U), U),
        ((L, S), L),
        ((S,), L),
        ((F, L), L),
        ((F, F), F),
        ((), L),
    ],
)
def test_the_workers_state_is_its_models_best(
    states: tuple[BackendState, ...], expected: BackendState
) -> None:
    assert worker_state(states) is expected


def _worker(*argv: str) -> WorkerSettings:
    args = build_parser().parse_args(["worker", *argv])
    return settings_from_args(WorkerSettings, args)


def test_model_repeats_on_the_command_line() -> None:
    settings = _worker("--model", "a/b", "--model", "c.gguf")
    assert settings.models == ("a/b", "c.gguf")
    assert settings.several_models
    assert [s.model for s in model_specs(settings)] == ["a/b", "c.gguf"]
    specs = model_specs(settings)
    assert [preloaded(s, i) for i, s in enumerate(specs)] == [True, False]
    assert not any(s.pinned for s in specs)


def test_a_model_named_twice_is_refused() -> None:
    with pytest.raises(WorkerConfigError, match="both named 'a'"):
        model_specs(WorkerSettings(model="a,b,a"))


def test_a_spec_that_says_whether_it_preloads_is_followed() -> None:
    assert not preloaded(ModelSpec(model="x", preload=False), 0)
    assert preloaded(ModelSpec(model="x", preload=True), 3)


def test_one_model_is_as_before() -> None:
    settings = _worker("--model", "smollm2-135m-instruct")
    assert settings.model == "smollm2-135m-instruct"
    assert not settings.several_models


def test_shoal_model_takes_several_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_MODEL", "a, b")
    settings = WorkerSettings()
    assert settings.models == ("a", "b") and settings.several_models


def test_a_models_file_alone_names_the_text_models(tmp_path: Path) -> None:
    file = tmp_path / "models.toml"
    file.write_text('[[models]]\nmodel = "x"\nalias = "one"\npinned = true\n')
    settings = WorkerSettings(models_file=file)
    assert plans_text(settings) and settings.several_models
    assert model_specs(settings) == (ModelSpec(model="x", alias="one", pinned=True),)
    with pytest.raises(WorkerConfigError, match="not both"):
        model_specs(WorkerSettings(models_file=file, model="y"))
    file.write_text('[[models]]\nmodel = "x"\nsize = 3\n')
    with pytest.raises(WorkerConfigError, match="unknown key"):  # the file's own error
        model_specs(WorkerSettings(models_file=file))


def test_each_model_gets_its_own_options_else_the_workers() -> None:
    settings = WorkerSettings(model="a,b", slots=4, ctx_size=4096, idle_unload=0)
    spec = ModelSpec(model="b", alias="bee", ctx_size=1024, idle_unload=30.0)
    mine = spec_settings(settings, spec)
    assert (mine.model, mine.model_alias, mine.ctx_size, mine.slots, mine.idle_unload) == (
        "b",
        "bee",
        1024,
        4,
        30.0,
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("backend_url", "http://127.0.0.1:9"),
        ("model_alias", "x"),
    ],
)
def test_one_model_flags_are_refused_with_several(flag: str, value: str) -> None:
    settings = WorkerSettings.model_validate({"model": "a,b", flag: value})
    with pytest.raises(WorkerConfigError, match="--" + flag.replace("_", "-")):
        _refuse_conflicts(settings)


def test_memory_budget_is_gib() -> None:
    assert _worker("--memory-budget", "0.5").memory_budget == 0.5
