"""Errors from finding, downloading and verifying model files."""

from __future__ import annotations


class ModelError(Exception):
    """A model could not be found, downloaded or verified.

    The message always says what to do next (which command to run, which file to delete).
    """


class HubError(ModelError):
    """Hugging Face Hub download or look-up failed: unreachable, gated, not found, or damaged.

    The message names the repo and file and says what to do (set ``HF_TOKEN``, fix
    ``HF_ENDPOINT``, pre-stage the file for offline mode, run the command again to resume).
    """


class StoreUnreachable(ModelError):
    """A model store (``shoal data``) could not be reached or did not answer like one.

    Unlike a model missing from a store, this says nothing about whether the model is there:
    the router answers 503 for it, not 404.
    """
