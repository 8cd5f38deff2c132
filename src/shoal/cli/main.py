"""``shoal``: the command line. Each subcommand builds its process's one settings object."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import cast

from shoal import __version__
from shoal.cli import commands
from shoal.cli import data as data_cli
from shoal.cli import keys as keys_cli
from shoal.cli import models as models_cli
from shoal.cli import service as service_cli
from shoal.cli.errors import UserError
from shoal.cli.parser import ShoalParser
from shoal.data.settings import DataSettings
from shoal.router.settings import RouterSettings
from shoal.settings import add_settings_flags
from shoal.up.settings import UpSettings
from shoal.worker.settings import WorkerSettings

DESCRIPTION = """\
Shoal: one OpenAI-compatible endpoint over your own machines, running llama.cpp.

  shoal up                                  router + worker + a small model, on this machine
  shoal router --host 0.0.0.0 --api-key K --gpu-key G        the front door
  shoal worker --router-url HOST:8000 --gpu-key G            on each GPU machine (dials out)
  shoal doctor --router-url HOST:8000 --gpu-key G            is this machine right for it?

Every option also reads a SHOAL_* environment variable (--max-queue <-> SHOAL_MAX_QUEUE);
a server's --api-key reads its own (SHOAL_ROUTER_API_KEY, SHOAL_DATA_API_KEY), never a
client's. Clients read OPENAI_BASE_URL and OPENAI_API_KEY.
"""

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = ShoalParser(
        prog="shoal", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    # Typed as the base class the command modules take; at run time every sub-parser is a
    # ShoalParser (argparse makes them of the parent's class).
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", metavar="COMMAND", required=True),
    )

    def add(name: str, help_text: str, handler: Handler) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    add_settings_flags(
        add("up", "Run a router, a worker and the default model here.", commands.up), UpSettings
    )
    add_settings_flags(
        add("router", "Run the router: the OpenAI-compatible front door.", commands.router),
        RouterSettings,
    )
    worker = add("worker", "Run a worker that dials out to a router.", commands.worker)
    add_settings_flags(worker, WorkerSettings)
    service_cli.add_commands(worker)
    data = add(
        "data",
        "Run a model store that serves GGUF files to workers (`shoal data upload FILE` puts "
        "one into a store).",
        commands.data,
    )
    add_settings_flags(data, DataSettings)
    data_cli.add_commands(data)
    doctor = add(
        "doctor",
        "Check this machine for `shoal worker` (same options): GPUs, driver, llama.cpp backend "
        "and build, model fit, router; exit status 1 on problems.",
        commands.doctor,
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_settings_flags(doctor, WorkerSettings)

    llama = add("llama-cpp", "Find or build the llama.cpp binaries.", commands.help_)
    llama_sub = llama.add_subparsers(dest="llama_command", metavar="ACTION", required=True)
    for action, text, handler in (
        (
            "which",
            "Print which llama-server will be used and why (builds nothing).",
            commands.llama_cpp_which,
        ),
        (
            "install",
            "Get llama-server and ggml-rpc-server: the pinned release, else a build from source.",
            commands.llama_cpp_install,
        ),
    ):
        p = llama_sub.add_parser(action, help=text, description=text)
        p.set_defaults(handler=handler)
        add_settings_flags(p, commands.LlamaCppSettings)

    models = add("models", "The model catalog and this machine's model cache.", commands.help_)
    models_sub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    models_cli.add_commands(models_sub)
    keys_cli.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except UserError as exc:
        print(f"shoal: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def path_env() -> str | None:
    return os.environ.get("PATH")
