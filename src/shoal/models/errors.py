"""Errors from finding, downloading and verifying model files."""

from __future__ import annotations


class ModelError(Exception):
    """A model could not be found, downloaded or verified.

    The message always says what to do next (which command to run, which file to delete).
    """
