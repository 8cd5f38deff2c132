"""Errors from getting, building and finding llama.cpp binaries."""

from __future__ import annotations


class LlamaCppError(Exception):
    """llama.cpp binaries could not be fetched, built or found.

    The message always says what to do next (what to install, which command to run,
    which file to look at).
    """
