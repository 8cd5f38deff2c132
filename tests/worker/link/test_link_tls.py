"""The worker's router link over wss://: it registers with a router whose CA it was given, and
stops at once (no retry loop) with a message naming --tls-ca when it cannot verify the router.

The router is the real one, served in-process over HTTPS/WSS on a free loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from certs import Certs, make_certs
from link_rig import router_link
from shoal import serving
from shoal.protocol.messages import (
    WS_PATH,
)
from shoal.router.app import serve
from shoal.router.settings import RouterSettings
from shoal.worker.backoff import Backoff
from shoal.worker.link.router_link import LinkState, RouterLink
from shoal.worker.tls import UntrustedRouter, client_tls_context

LINK_TIMEOUT_S = 15.0


@pytest.fixture(autouse=True)
def key_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each router here keeps its key database in the test's own folder."""
    monkeypatch.setenv("SHOAL_DATABASE_URL", f"sqlite:///{tmp_path / 'keys.db'}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def wss_url(certs: Certs) -> AsyncIterator[str]:
    """The worker socket of a real router served over TLS in-process."""
    settings = RouterSettings(host="127.0.0.1", port=0, tls_cert=certs.cert, tls_key=certs.key)
    sock = serving.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    task = asyncio.create_task(serve(settings, sock))
    yield f"wss://127.0.0.1:{port}{WS_PATH}"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def link(url: str, ca: Path | None) -> RouterLink:
    never_wait = Backoff(base=0.01, cap=0.01)  # a retry would show up at once, not hide
    return router_link(url, ca=ca, backoff=never_wait)


async def test_a_worker_given_the_ca_registers_over_wss(wss_url: str, certs: Certs) -> None:
    the_link = link(wss_url, certs.ca)
    running = asyncio.create_task(the_link.run())
    try:
        async with asyncio.timeout(LINK_TIMEOUT_S):
            await asyncio.shield(the_link.default_model)
        assert the_link.state is LinkState.REGISTERED
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


@pytest.mark.parametrize("trust", ["system CAs", "another CA"])
async def test_an_unverifiable_router_stops_the_link_with_advice(
    wss_url: str, certs: Certs, trust: str
) -> None:
    the_link = link(wss_url, None if trust == "system CAs" else certs.other_ca)
    async with asyncio.timeout(LINK_TIMEOUT_S):
        with pytest.raises(UntrustedRouter) as info:
            await the_link.run()
    message = str(info.value)
    assert "cannot verify the TLS certificate of the router" in message
    assert "--tls-ca" in message and wss_url in message
    assert info.value.fatal
    assert not the_link.default_model.done(), "it never registered"


def test_an_unusable_ca_file_is_named(tmp_path: Path, certs: Certs) -> None:
    with pytest.raises(UntrustedRouter, match="cannot use .*nope.pem as the CA certificate"):
        client_tls_context(tmp_path / "nope.pem")
    with pytest.raises(UntrustedRouter, match="--tls-ca"):
        client_tls_context(certs.key)  # a key, not a certificate
