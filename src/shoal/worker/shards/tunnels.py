"""The worker's ends of the router's RPC tunnels (``shoal.tunnel``), for split models.

A head's ``llama-server --rpc`` dials a local port per stage (``head_end``); every connection
it opens there is carried to the router's tunnel listener, which asks the stage's worker
(``TunnelDial``) to join it to its ``ggml-rpc-server`` (``connect_stage``). Both sides prove
themselves with the tunnel's secrets; no worker listens on anything but 127.0.0.1.

The head's end times each stage's answers; while the head serves it reports them to the router
every ``LINK_REPORT_S`` when a stage answered something new (``link_report``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Mapping

from shoal.protocol.ids import WorkerId
from shoal.protocol.shards import LinkRtt, RpcPeer, ShardLinks, TunnelDial
from shoal.tunnel.endpoints import HeadEndpoint, HubAddress, StageConnector, TunnelError
from shoal.tunnel.handshake import StageWanted, TunnelId

log = logging.getLogger(__name__)


class TunnelEnds:
    def __init__(self, router_host: Callable[[], str], tls: ssl.SSLContext | None) -> None:
        """``router_host``: the host this worker dials its router at now (the tunnel listener
        is there too); ``tls``: verify it (a ``wss://`` router), else plain TCP."""
        self.router_host = router_host
        self.tls = tls
        self._stages: dict[str, StageConnector] = {}

    def _hub(self, port: int) -> HubAddress:
        host = self.router_host()
        return HubAddress(host, port, self.tls, server_hostname=host if self.tls else None)

    @contextlib.asynccontextmanager
    async def head_end(self, peer: RpcPeer) -> AsyncIterator[HeadEndpoint]:
        """A listener on 127.0.0.1 (its ``port``) that reaches ``peer``'s ggml-rpc-server
        through the router, and times the stage's answers (its ``turnarounds``)."""
        if peer.tunnel_id is None or peer.tunnel_token is None or peer.tunnel_port is None:
            raise ValueError(f"stage {peer.worker_id}: neither a tunnel nor a direct address")
        endpoint = HeadEndpoint(
            self._hub(peer.tunnel_port), TunnelId(peer.tunnel_id), peer.tunnel_token
        )
        serving = asyncio.ensure_future(endpoint.serve())  # awaited below, on every path
        try:
            started = asyncio.ensure_future(endpoint.started.wait())
            await asyncio.wait({serving, started}, return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            if serving.done():
                serving.result()  # raises why it could not listen
            yield endpoint
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving

    async def connect_stage(self, msg: TunnelDial, host: str, port: int) -> None:
        """Join one head connection of a tunnel to the ggml-rpc-server at ``host:port``;
        returns when that connection ends."""
        connector = self._stages.get(msg.deployment)
        if connector is None or connector.rpc_port != port:
            connector = StageConnector(self._hub(msg.port), port, rpc_host=host)
            self._stages[msg.deployment] = connector
        wanted = StageWanted(TunnelId(msg.tunnel_id), msg.conn_no, msg.token)
        try:
            await connector.connect(wanted)
        except TunnelError as exc:
            log.warning("deployment %s: %s", msg.deployment, exc)

    def close_stage(self, deployment: str) -> None:
        """End the deployment's relayed connections (its stage stopped)."""
        connector = self._stages.pop(deployment, None)
        if connector is not None:
            connector.close()


def link_report(
    deployment: str,
    now: Mapping[WorkerId, tuple[int, ...]],
    sent: Mapping[WorkerId, tuple[int, ...]],
) -> ShardLinks | None:
    """What a head tells the router of its stages' round trips: each stage's last turnarounds
    (ns) summed up, or None when no stage answered anything since ``sent`` was reported."""
    if now == sent:
        return None
    stages = tuple(r for w, ns in now.items() if (r := LinkRtt.of(w, ns)) is not None)
    return ShardLinks(deployment=deployment, stages=stages) if stages else None
