"""The hello line and its answer (pure)."""

from __future__ import annotations

import pytest

from shoal.tunnel.handshake import (
    MAX_LINE_BYTES,
    HandshakeError,
    Hello,
    Side,
    StageWanted,
    TunnelId,
    TunnelRefused,
    err_line,
    new_token,
    ok_line,
    parse_hello,
    parse_reply,
    split_line,
)

TOKEN = new_token()


def test_hello_round_trip_and_token_hidden() -> None:
    head = Hello(TunnelId("t-1"), Side.HEAD, None, TOKEN)
    stage = StageWanted(TunnelId("t-1"), 3, TOKEN).hello()
    assert parse_hello(head.encode()) == head
    assert parse_hello(stage.encode()) == stage
    assert stage.encode() == f"SHOAL-TUNNEL/1 t-1 stage 3 {TOKEN}\n".encode()
    for obj in (head, stage, StageWanted(TunnelId("t-1"), 3, TOKEN)):
        assert TOKEN not in repr(obj)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"GET / HTTP/1.1\r\n", "not a tunnel hello"),
        (b"\xff\xfe garbage\n", "not a tunnel hello"),
        (f"SHOAL-TUNNEL/2 t-1 head - {TOKEN}\n".encode(), "not a tunnel hello"),
        (f"SHOAL-TUNNEL/1 t/1 head - {TOKEN}\n".encode(), "malformed tunnel id"),
        (b"SHOAL-TUNNEL/1 t-1 head - short\n", "malformed token"),
        (f"SHOAL-TUNNEL/1 t-1 tail - {TOKEN}\n".encode(), "side must be head or stage"),
        (f"SHOAL-TUNNEL/1 t-1 head 4 {TOKEN}\n".encode(), "a head connection sends '-'"),
        (f"SHOAL-TUNNEL/1 t-1 stage - {TOKEN}\n".encode(), "a stage connection sends"),
        (f"SHOAL-TUNNEL/1 t-1 stage 0 {TOKEN}\n".encode(), "a stage connection sends"),
    ],
)
def test_bad_hellos_are_refused_with_a_reason(line: bytes, reason: str) -> None:
    with pytest.raises(HandshakeError) as caught:
        parse_hello(line)
    assert caught.value.reason.startswith(reason)
    assert TOKEN not in caught.value.reason


def test_replies() -> None:
    assert parse_reply(ok_line(12)) == 12
    with pytest.raises(TunnelRefused, match="unknown tunnel t-9"):
        parse_reply(err_line("unknown tunnel t-9"))
    with pytest.raises(TunnelRefused, match="unexpected answer"):
        parse_reply(b"HTTP/1.1 400 Bad Request\r\n")


def test_split_line_keeps_what_follows_and_limits_length() -> None:
    assert split_line(b"partial") is None
    assert split_line(b"OK 1\nraw bytes") == (b"OK 1\n", b"raw bytes")
    with pytest.raises(HandshakeError, match="too long"):
        split_line(b"x" * MAX_LINE_BYTES)
    with pytest.raises(HandshakeError, match="too long"):
        split_line(b"x" * MAX_LINE_BYTES + b"\n")
