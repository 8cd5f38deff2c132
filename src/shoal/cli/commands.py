"""What each subcommand does: build settings, check them, run the role's composition root."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TypeVar

from pydantic_settings import BaseSettings

from shoal.cli import logs
from shoal.cli.errors import UserError, settings_for
from shoal.cli.run import run
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.options import LlamaCppOptions
from shoal.models.errors import ModelError
from shoal.settings import client_key_ignored, flag_and_variable

log = logging.getLogger(__name__)

S = TypeVar("S", bound=BaseSettings)


LlamaCppSettings = LlamaCppOptions


_settings = settings_for


def _path_env() -> str | None:
    return os.environ.get("PATH")


def _warn_client_key(server: str, settings_cls: type[BaseSettings], database: bool) -> None:
    """One WARNING when a client's key variable is set where a server starts: it used to
    open the router to that key; now it is ignored, and a user upgrading is told so."""
    accepted = flag_and_variable(settings_cls, "api_key")
    if database:
        accepted = f"its key database (`shoal keys create`) and {accepted}"
    warning = client_key_ignored(os.environ, server, accepted)
    if warning is not None:
        log.warning("%s", warning)


def router(args: argparse.Namespace) -> int:
    from shoal.router.app import RouterConfigError, build_app, serve
    from shoal.router.settings import RouterSettings

    settings = _settings(RouterSettings, args)
    logs.setup(settings.log_level)
    _warn_client_key("this router", RouterSettings, database=True)
    try:
        build_app(settings)
    except RouterConfigError as exc:
        raise UserError(str(exc)) from None
    try:
        run(serve(settings, own_process=True))
    except RouterConfigError as exc:
        raise UserError(str(exc)) from None
    return 0


def data(args: argparse.Namespace) -> int:
    from shoal.data.app import DataConfigError, serve
    from shoal.data.settings import DataSettings

    settings = _settings(DataSettings, args)
    logs.setup(settings.log_level)
    _warn_client_key("this model store", DataSettings, database=settings.database_url is not None)
    try:
        run(serve(settings))
    except DataConfigError as exc:
        raise UserError(str(exc)) from None
    return 0


def worker(args: argparse.Namespace) -> int:
    from shoal.worker.hardware import detect_profile
    from shoal.worker.link.drain import Drain
    from shoal.worker.main import run_worker
    from shoal.worker.serving import TextPlan
    from shoal.worker.settings import WorkerSettings
    from shoal.worker.text.plan import WorkerConfigError, plan, plans_text
    from shoal.worker.text.residency.planned import plan_models
    from shoal.worker.tls import Refusal

    settings = _settings(WorkerSettings, args)
    logs.setup(settings.log_level)
    path_env = _path_env()
    try:
        machine = detect_profile()
        # With no model given, the router's default is resolved once registered.
        the_plan: TextPlan | None = None
        if settings.several_models:
            the_plan = plan_models(settings, path_env, machine)
        elif plans_text(settings):
            the_plan = plan(settings, path_env, machine)
    except (LlamaCppError, ModelError, WorkerConfigError) as exc:
        raise UserError(str(exc)) from None
    try:
        stop = Drain()  # SIGTERM drains the worker first (a second one stops it at once)
        main = run_worker(settings, the_plan, path_env=path_env, machine=machine, stop=stop)
        run(main, on_sigterm=stop.request)
    except* (Refusal, LlamaCppError, ModelError, WorkerConfigError) as group:
        raise UserError(str(group.exceptions[0])) from None
    return 0


def up(args: argparse.Namespace) -> int:
    from shoal.up.main import UpError, run_up
    from shoal.up.settings import UpSettings

    settings = _settings(UpSettings, args)
    logs.setup(settings.log_level)
    _warn_client_key("this router", UpSettings, database=True)
    try:
        run(run_up(settings, _path_env()))
    except* (UpError, LlamaCppError, ModelError) as group:
        raise UserError(str(group.exceptions[0])) from None
    return 0


def doctor(args: argparse.Namespace) -> int:
    from shoal.cli.doctor import doctor as run_doctor

    return run_doctor(args)


def help_(args: argparse.Namespace) -> int:
    raise UserError("choose an action; see --help")


def llama_cpp_which(args: argparse.Namespace) -> int:
    """What would run, building nothing: flag, cache, then PATH."""
    return _llama_cpp(args, install=False)


def llama_cpp_install(args: argparse.Namespace) -> int:
    """Shoal's own copy (cache, else the pinned release, else build now); PATH is not used."""
    return _llama_cpp(args, install=True)


def _llama_cpp(args: argparse.Namespace, *, install: bool) -> int:
    from shoal.llama_cpp.locate import describe
    from shoal.llama_cpp.options import binaries

    settings = _settings(LlamaCppSettings, args)
    logs.setup(settings.log_level)
    try:
        found = binaries(settings, None if install else _path_env(), allow_build=install)
    except LlamaCppError as exc:
        raise UserError(str(exc)) from None
    print(describe(found))
    return 0
