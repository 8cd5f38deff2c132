"""What a worker says when it cannot join its router: pure functions of what went wrong.

``refusal_text`` words a ``Refused`` the router sent (for a bad key: how to get a worker key,
since retrying cannot help). ``failure_reason`` is a failed dial in one short clause (a close
frame's code and reason once, not websockets' "received X; then sent X"), and ``advice`` what
to check for that kind of failure, for the one warning of a worker that has never joined.
"""

from __future__ import annotations

import socket
import ssl

import orjson
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

from shoal.protocol.messages import RefusalCode, Refused

WORKER_KEY_FIX = (
    "Give this worker a worker key with --gpu-key (or SHOAL_GPU_KEY): `shoal keys create "
    "--scope worker` prints one on the router's machine, or use one of the router's --gpu-key."
)


def refusal_text(refused: Refused, url: str, *, keyed: bool) -> str:
    """The error for a worker the router at ``url`` refused; ``keyed``: it presented a key."""
    text = f"the router at {url} refused this worker ({refused.code}): {refused.reason}"
    if refused.code is RefusalCode.BAD_KEY:
        given = "its key is not one of the router's" if keyed else "it gave no key"
        return f"{text}; {given}. {WORKER_KEY_FIX}"
    return text


def failure_reason(exc: BaseException) -> str:
    """A failed dial or a lost connection, in one clause."""
    if isinstance(exc, ConnectionClosed):
        close = exc.rcvd
        if close is None:
            return "the connection closed without a close frame"
        reason = f": {close.reason}" if close.reason else ""
        return f"the router closed the connection ({close.code}{reason})"
    if isinstance(exc, InvalidStatus):
        said = _error_message(exc.response.body)
        return f"HTTP {exc.response.status_code} to the WebSocket handshake" + (
            f": {said}" if said else ""
        )
    return f"{type(exc).__name__}: {exc}"


def _error_message(body: bytes | bytearray | None) -> str | None:
    """The message of an OpenAI-style error body (a Shoal server's), if that is what it is."""
    try:
        error = orjson.loads(bytes(body or b"")).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


_LISTENING = (
    "that the router runs and listens there (its --host and --port: it listens on 127.0.0.1 "
    "only unless given --host 0.0.0.0)"
)
_SCHEME = (
    "the scheme: a router with --tls-cert needs wss:// (or --tls-ca with host:port), one "
    "without it ws:// (or host:port)"
)


def advice(exc: BaseException | None) -> str:
    """What to check after ``exc``, the last failure of a worker that never joined."""
    if isinstance(exc, ConnectionRefusedError):
        return f"Nothing accepts connections there: check {_LISTENING}."
    if isinstance(exc, socket.gaierror):
        return "The router's host name does not resolve here: check the host in --router-url."
    if isinstance(exc, ssl.SSLError | InvalidMessage):
        return f"Check {_SCHEME}."
    if isinstance(exc, InvalidStatus):
        return (
            "Something answered there that is not a Shoal router's worker socket: check that "
            "the host and port in --router-url are the router's (its --port), and "
            f"{_SCHEME}."
        )
    return f"Check {_LISTENING}, that no firewall is in the way, and {_SCHEME}."
