"""What each subcommand does: build settings, check them, run the role's composition root."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings

from shoal.cli import logs
from shoal.cli.run import run
from shoal.llama_cpp.errors import LlamaCppError
from shoal.models.default import DEFAULT_MODEL
from shoal.models.errors import ModelError
from shoal.settings import CommonSettings, settings_from_args

S = TypeVar("S", bound=BaseSettings)


class UserError(Exception):
    """Something the user can fix; printed without a traceback."""


class LlamaCppSettings(CommonSettings):
    llama_server_path: Path | None = Field(
        None, description="llama-server binary to use instead of the cached or built one."
    )


class ModelsSettings(CommonSettings):
    pass


def _settings(cls: type[S], args: argparse.Namespace) -> S:
    try:
        return settings_from_args(cls, args)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
        )
        raise UserError(f"invalid option: {problems}") from None


def _path_env() -> str | None:
    return os.environ.get("PATH")


def router(args: argparse.Namespace) -> int:
    from shoal.router.app import RouterConfigError, build_app, serve
    from shoal.router.settings import RouterSettings

    settings = _settings(RouterSettings, args)
    logs.setup(settings.log_level)
    try:
        build_app(settings)
    except RouterConfigError as exc:
        raise UserError(str(exc)) from None
    try:
        run(serve(settings))
    except RouterConfigError as exc:
        raise UserError(str(exc)) from None
    return 0


def data(args: argparse.Namespace) -> int:
    from shoal.data.app import DataConfigError, build_app, serve
    from shoal.data.settings import DataSettings

    settings = _settings(DataSettings, args)
    logs.setup(settings.log_level)
    try:
        app = build_app(settings)
        run(serve(settings, app=app))
    except DataConfigError as exc:
        raise UserError(str(exc)) from None
    return 0


def worker(args: argparse.Namespace) -> int:
    from shoal.worker.link import Refusal
    from shoal.worker.main import WorkerConfigError, plan, run_worker
    from shoal.worker.settings import WorkerSettings

    settings = _settings(WorkerSettings, args)
    logs.setup(settings.log_level)
    try:
        the_plan = plan(settings, _path_env())
    except (LlamaCppError, ModelError, WorkerConfigError) as exc:
        raise UserError(str(exc)) from None
    try:
        run(run_worker(settings, the_plan))
    except* Refusal as group:
        raise UserError(str(group.exceptions[0])) from None
    return 0


def up(args: argparse.Namespace) -> int:
    from shoal.up.main import UpError, run_up
    from shoal.up.settings import UpSettings

    settings = _settings(UpSettings, args)
    logs.setup(settings.log_level)
    try:
        run(run_up(settings, _path_env()))
    except* (UpError, LlamaCppError, ModelError) as group:
        raise UserError(str(group.exceptions[0])) from None
    return 0


def llama_cpp_help(args: argparse.Namespace) -> int:
    raise UserError("choose an action; see --help")


def llama_cpp_which(args: argparse.Namespace) -> int:
    """What would run, building nothing: flag, cache, then PATH."""
    return _llama_cpp(args, install=False)


def llama_cpp_install(args: argparse.Namespace) -> int:
    """Shoal's own build (cache, else build now); PATH is not consulted."""
    return _llama_cpp(args, install=True)


def _llama_cpp(args: argparse.Namespace, *, install: bool) -> int:
    from shoal.llama_cpp.locate import describe, resolve

    settings = _settings(LlamaCppSettings, args)
    logs.setup(settings.log_level)
    try:
        found = resolve(
            explicit=settings.llama_server_path,
            cache_dir=settings.cache_dir,
            path_env=None if install else _path_env(),
            allow_build=install,
        )
    except LlamaCppError as exc:
        raise UserError(str(exc)) from None
    print(describe(found))
    return 0


def models_pull(args: argparse.Namespace) -> int:
    from shoal.models.resolve import resolve_model

    settings = _settings(ModelsSettings, args)
    logs.setup(settings.log_level)
    try:
        local = resolve_model(args.model or DEFAULT_MODEL.id, settings.cache_dir)
    except ModelError as exc:
        raise UserError(str(exc)) from None
    print(f"{local.id}: {local.path}")
    return 0


def models_inspect(args: argparse.Namespace) -> int:
    from shoal.models.gguf_info import inspect, to_json
    from shoal.models.gguf_report import describe
    from shoal.models.resolve import resolve_model

    settings = _settings(ModelsSettings, args)
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
