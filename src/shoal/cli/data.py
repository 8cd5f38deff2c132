"""``shoal data upload FILE``: put a GGUF file into a model store, resumably, sha256-checked.

(``shoal data`` itself runs the store: ``commands.data``.)
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr

from shoal.cli import logs
from shoal.cli.errors import UserError, settings_for
from shoal.settings import CommonSettings, Variable, add_settings_flags

Parser = argparse.ArgumentParser


class UploadSettings(CommonSettings):
    store: Annotated[str, Variable("SHOAL_MODEL_STORE")] = Field(
        "http://127.0.0.1:8100",
        description="The model store: `shoal data`'s URL (https:// when it serves TLS), or a "
        "router's with --storage.",
    )
    key: Annotated[SecretStr | None, Variable("SHOAL_UPLOAD_KEY")] = Field(
        None, description="An admin key of the store (its --admin-key, or a key database's)."
    )
    id: Annotated[str | None, Variable("SHOAL_UPLOAD_ID")] = Field(
        None, description="The model's id in the store (default: the file name without .gguf)."
    )
    overwrite: bool = Field(False, description="Replace a model of the same id.")
    tls_ca: Path | None = Field(
        None,
        description="CA certificate (PEM) that signed the store's TLS certificate (default: "
        "the system's trusted CAs).",
    )


def add_commands(data: Parser) -> None:
    """``upload`` under ``shoal data`` (which runs the store when given no action)."""
    sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=False)
    text = (
        "Upload a GGUF file to a model store, with a progress bar; an interrupted upload "
        "continues where the store stopped (run it again), and the store keeps the file only "
        "if its sha256 matches."
    )
    upload = sub.add_parser("upload", help=text, description=text)
    upload.set_defaults(handler=upload_command)
    upload.add_argument("file", type=Path, metavar="FILE", help="the .gguf file")
    add_settings_flags(upload, UploadSettings)


def upload_command(args: argparse.Namespace) -> int:
    from shoal.models.errors import ModelError
    from shoal.models.store_upload import upload_to_store
    from shoal.worker.tls import Refusal, client_tls_context

    settings = settings_for(UploadSettings, args)
    logs.setup(settings.log_level)
    path: Path = args.file
    if not path.is_file():
        raise UserError(f"{path} is not a file.")
    try:
        tls = client_tls_context(settings.tls_ca) if settings.store.startswith("https") else None
    except Refusal as exc:
        raise UserError(str(exc).replace("router", "store")) from None
    key = settings.key.get_secret_value() if settings.key else None
    try:
        done = asyncio.run(
            upload_to_store(
                settings.store,
                path,
                model_id=settings.id,
                api_key=key,
                overwrite=settings.overwrite,
                tls=tls,
            )
        )
    except ModelError as exc:
        raise UserError(str(exc)) from None
    resumed = f", resumed at byte {done.resumed_from}" if done.resumed_from else ""
    print(f"stored {done.id}: {done.size} bytes, sha256 {done.sha256} (verified{resumed})")
    return 0
