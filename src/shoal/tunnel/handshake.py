"""The one line a tunnel connection opens with, and the one line it is answered with.

    SHOAL-TUNNEL/1 <tunnel-id> head - <token>\\n         a head worker's connection
    SHOAL-TUNNEL/1 <tunnel-id> stage <conn-no> <token>\\n  a stage worker answering conn-no
    OK <conn-no>\\n                                       paired: raw bytes from here on
    ERR <reason>\\n                                       refused; the hub then closes

The hub numbers each head connection (1, 2, ...) and asks the stage worker to dial back with
that number, because one ``ggml-rpc-server`` connection serves exactly one head connection.
A dialler sends its line and waits for the answer before sending anything else.
Tokens never appear in logs or reprs: ``Hello`` hides its token.
"""

from __future__ import annotations

import hmac
import re
import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

TunnelId = NewType("TunnelId", str)

MAGIC = "SHOAL-TUNNEL/1"
MAX_LINE_BYTES = 256
"""A hello is well under this; more without a newline is garbage."""
HANDSHAKE_TIMEOUT_S = 5.0
"""How long the hub waits for a connection's hello line."""
STAGE_TIMEOUT_S = 5.0
"""How long the hub holds a head connection while the stage worker dials back."""

_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")


class Side(StrEnum):
    HEAD = "head"
    STAGE = "stage"


class HandshakeError(Exception):
    """A hello line that cannot be accepted; ``reason`` is safe to send back and to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TunnelRefused(Exception):
    """The hub answered ``ERR``: the reason it gave."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def new_tunnel_id() -> TunnelId:
    return TunnelId("t-" + secrets.token_hex(6))


def token_matches(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode(), expected.encode())


@dataclass(frozen=True)
class Hello:
    tunnel_id: TunnelId
    side: Side
    conn_no: int | None
    """The head connection a stage answers; None for a head."""
    token: str = field(repr=False)

    def encode(self) -> bytes:
        conn = "-" if self.conn_no is None else str(self.conn_no)
        return f"{MAGIC} {self.tunnel_id} {self.side} {conn} {self.token}\n".encode()


@dataclass(frozen=True)
class StageWanted:
    """What a stage worker needs to dial the hub back for one head connection.

    The router sends it to the stage worker (over its WebSocket) with the hub's address.
    """

    tunnel_id: TunnelId
    conn_no: int
    token: str = field(repr=False)

    def hello(self) -> Hello:
        return Hello(self.tunnel_id, Side.STAGE, self.conn_no, self.token)


def parse_hello(line: bytes) -> Hello:
    """The hello in ``line`` (with or without its newline); HandshakeError if it is not one."""
    try:
        text = line.decode("ascii").rstrip("\r\n")
    except UnicodeDecodeError:
        raise HandshakeError("not a tunnel hello") from None
    parts = text.split(" ")
    if len(parts) != 5 or parts[0] != MAGIC:
        raise HandshakeError(f"not a tunnel hello (expected '{MAGIC} <id> <side> <conn> <token>')")
    _, tunnel_id, side_text, conn_text, token = parts
    if not _ID.fullmatch(tunnel_id):
        raise HandshakeError("malformed tunnel id")
    if not _TOKEN.fullmatch(token):
        raise HandshakeError("malformed token")
    try:
        side = Side(side_text)
    except ValueError:
        raise HandshakeError("side must be head or stage") from None
    return Hello(TunnelId(tunnel_id), side, _conn_no(side, conn_text), token)


def _conn_no(side: Side, text: str) -> int | None:
    if side is Side.HEAD:
        if text != "-":
            raise HandshakeError("a head connection sends '-' for its connection number")
        return None
    if not text.isdigit() or not 0 < int(text) < 1 << 31:
        raise HandshakeError("a stage connection sends the connection number it answers")
    return int(text)


def ok_line(conn_no: int) -> bytes:
    return f"OK {conn_no}\n".encode()


def err_line(reason: str) -> bytes:
    return f"ERR {reason}\n".encode("ascii", "replace")


def parse_reply(line: bytes) -> int:
    """The connection number an ``OK`` carries; TunnelRefused for ``ERR`` or anything else."""
    text = line.decode("ascii", "replace").rstrip("\r\n")
    if text.startswith("OK ") and text[3:].isdigit():
        return int(text[3:])
    if text.startswith("ERR "):
        raise TunnelRefused(text[4:])
    raise TunnelRefused(f"unexpected answer from the tunnel hub: {text[:80]!r}")


def split_line(buffer: bytes) -> tuple[bytes, bytes] | None:
    """(line with newline, bytes after it) once ``buffer`` holds a newline, else None.

    HandshakeError if ``buffer`` is already longer than a line may be.
    """
    end = buffer.find(b"\n")
    if end < 0:
        if len(buffer) >= MAX_LINE_BYTES:
            raise HandshakeError("hello line too long")
        return None
    if end >= MAX_LINE_BYTES:
        raise HandshakeError("hello line too long")
    return buffer[: end + 1], buffer[end + 1 :]
