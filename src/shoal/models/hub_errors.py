"""Turning huggingface_hub and HTTP failures into one :class:`HubError` that says what to do."""

from __future__ import annotations

from typing import Protocol

import httpx2
from huggingface_hub.errors import (
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from shoal.models.errors import HubError


class HubAddress(Protocol):
    """What the messages name of ``hub.HubConfig`` (``hub`` imports this module)."""

    @property
    def url(self) -> str: ...

    @property
    def token(self) -> str | None: ...


HUB_FAILURES: tuple[type[Exception], ...] = (OSError, httpx2.HTTPError)
"""What talking to the Hub can raise: huggingface_hub's errors are OSErrors, httpx2's are not."""


def hub_error(
    exc: Exception,
    config: HubAddress,
    repo: str | None,
    file: str | None,
    revision: str | None,
) -> HubError:
    """The :class:`HubError` for ``exc``, raised while fetching ``file`` of ``repo``."""
    what = _describe(repo, file, revision)
    if isinstance(exc, OfflineModeIsEnabled):
        return HubError(
            f"cannot fetch {what}: huggingface_hub was imported with HF_HUB_OFFLINE set, so it "
            "makes no requests. Unset HF_HUB_OFFLINE, or copy the files into the cache."
        )
    if isinstance(exc, HfHubHTTPError):
        return _http_error(exc, config, repo, file, revision, what)
    if isinstance(exc, FileMetadataError):
        return HubError(
            f"{config.url} does not answer like a Hugging Face Hub for {what} ({exc}). "
            "Check HF_ENDPOINT."
        )
    if isinstance(exc, httpx2.TransportError):
        return HubError(
            f"cannot reach the Hugging Face Hub at {config.url} for {what}: "
            f"{exc or type(exc).__name__}. Check the network connection and HF_ENDPOINT "
            "(unset it for huggingface.co); to run only models already downloaded, set "
            "HF_HUB_OFFLINE=1."
        )
    return HubError(f"fetching {what} from {config.url} failed: {exc or type(exc).__name__}")


def _describe(repo: str | None, file: str | None, revision: str | None) -> str:
    if repo is None:
        return "the model search"
    at = f" (revision {revision})" if revision else ""
    return f"{file} of repo {repo}{at}" if file else f"repo {repo}{at}"


def _http_error(
    exc: HfHubHTTPError,
    config: HubAddress,
    repo: str | None,
    file: str | None,
    revision: str | None,
    what: str,
) -> HubError:
    status = exc.response.status_code
    page = f"{config.url}/{repo}" if repo else config.url
    if isinstance(exc, GatedRepoError) or status == 403 or (status == 401 and config.token):
        return HubError(_access_message(config, repo or "this repo", page, status))
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            f"repo {repo} was not found on {config.url} (HTTP {status}). Check the repo id; if "
            "the repo is private or gated, set HF_TOKEN to a token that may read it."
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"repo {repo} has no revision {revision!r} on {config.url}.")
    if isinstance(exc, RemoteEntryNotFoundError) or status == 404:
        return HubError(
            f"{file} was not found in repo {repo} at revision {revision} on {config.url} "
            "(HTTP 404). Check the file name, or list the repo's quantizations again."
        )
    detail = exc.server_message or str(exc).splitlines()[0]
    return HubError(
        f"the Hub at {config.url} answered HTTP {status} for {what}: {detail}. Try again later."
    )


def _access_message(config: HubAddress, repo: str, page: str, status: int) -> str:
    if not config.token:
        return (
            f"{repo} is gated or private (HTTP {status}) and no token was sent. Accept the "
            f"model's licence at {page} while logged in, create a read token at "
            f"{config.url}/settings/tokens, and set HF_TOKEN to it (or run `hf auth login`)."
        )
    return (
        f"{repo} is gated or private (HTTP {status}) and the token in HF_TOKEN has no access. "
        f"Accept the model's licence at {page} with the account that owns the token "
        "(access may need the authors' approval), or set HF_TOKEN to another token."
    )
