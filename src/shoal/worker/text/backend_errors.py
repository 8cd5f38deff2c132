"""What a backend's error answer says: the error object to pass on, and whether it refused the
prompt as longer than its context (pure)."""

from __future__ import annotations

import orjson

from shoal.protocol.messages import ErrorBody


def error_from_body(status: int, raw: bytes) -> ErrorBody:
    """The backend's error object, or a readable stand-in when it sent something else."""
    try:
        payload = orjson.loads(raw)
        err = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(err, dict):
            return ErrorBody(
                message=str(err.get("message", "backend error")),
                type=str(err.get("type", "server_error")),
                code=err.get("code") if isinstance(err.get("code"), str | int) else None,
            )
        if isinstance(err, str):
            return ErrorBody(message=err, type="server_error")
    except orjson.JSONDecodeError:
        pass
    text = raw.decode(errors="replace").strip()[:500] or f"HTTP {status}"
    return ErrorBody(message=f"backend answered {status}: {text}", type="server_error")


CONTEXT_ERROR = "exceed_context_size_error"
"""llama-server's error type for a prompt longer than its slot's context (400), with the
prompt's tokens (``n_prompt_tokens``) and the slot's context (``n_ctx``)."""


def context_needed(status: int, raw: bytes) -> int | None:
    """The context a prompt llama-server refused as too long needs (its tokens and one, at
    least the refusing slot's and one); None for any other answer."""
    if status != 400:
        return None
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict) or err.get("type") != CONTEXT_ERROR:
        return None
    counts = [err.get("n_prompt_tokens"), err.get("n_ctx")]
    known = [n for n in counts if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    return max(known) + 1 if known else None
