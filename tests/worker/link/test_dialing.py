"""What a worker says when it cannot join: the pure wording of refusals and failed dials."""

from __future__ import annotations

import socket
import ssl

import pytest
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.frames import Close
from websockets.http11 import Response

from shoal.protocol.messages import RefusalCode, Refused
from shoal.worker.link.dialing import advice, failure_reason, refusal_text

URL = "ws://r:8000/ws/worker"


def _status(code: int, body: bytes = b"") -> InvalidStatus:
    return InvalidStatus(Response(code, "x", Headers(), body))


def test_a_refused_key_says_how_to_get_a_worker_key() -> None:
    refused = Refused(code=RefusalCode.BAD_KEY, reason="the GPU key is missing or wrong")
    keyed = refusal_text(refused, URL, keyed=True)
    assert keyed.startswith(f"the router at {URL} refused this worker (bad_key): the GPU key")
    assert "its key is not one of the router's" in keyed
    assert "`shoal keys create --scope worker`" in keyed
    assert "it gave no key" in refusal_text(refused, URL, keyed=False)
    other = Refused(code=RefusalCode.DUPLICATE_ID, reason="worker id w-1 is already connected")
    assert "shoal keys" not in refusal_text(other, URL, keyed=True)


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        # websockets' own text names the reason twice ("received …; then sent …").
        (
            ConnectionClosedError(Close(4001, "bad key"), Close(4001, "bad key"), True),
            "the router closed the connection (4001: bad key)",
        ),
        (ConnectionClosedError(None, None), "the connection closed without a close frame"),
        (_status(403), "HTTP 403 to the WebSocket handshake"),
        (
            _status(400, b'{"error": {"message": "this port serves HTTPS"}}'),
            "HTTP 400 to the WebSocket handshake: this port serves HTTPS",
        ),
        (_status(502, b"<html>bad gateway</html>"), "HTTP 502 to the WebSocket handshake"),
        (ConnectionRefusedError(111, "Connection refused"), "ConnectionRefusedError: "),
    ],
)
def test_a_failed_dial_is_one_clause_naming_its_reason_once(exc: Exception, reason: str) -> None:
    assert failure_reason(exc).startswith(reason)
    assert failure_reason(exc).count("bad key") <= 1


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (ConnectionRefusedError(), "Nothing accepts connections there"),
        (socket.gaierror(), "does not resolve"),
        (ssl.SSLError(), "Check the scheme"),
        (_status(403), "not a Shoal router's worker socket"),
        (TimeoutError(), "no firewall"),
        (None, "no firewall"),
    ],
)
def test_the_warning_advises_for_the_way_the_dial_failed(
    exc: BaseException | None, says: str
) -> None:
    assert says in advice(exc)
    if not isinstance(exc, TimeoutError | type(None)):
        assert "firewall" not in advice(exc)
