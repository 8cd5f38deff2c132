"""The RPC tunnels between heads and stages: ``shoal.tunnel``'s hub, told about workers.

One tunnel per (deployment, stage). The head gets the tunnel's id, its head secret and the
hub's port in ``RpcPeer``; when the head opens a connection the hub asks for the stage's,
which this module passes on to the stage worker over its WebSocket (``TunnelDial``, with the
stage secret). Secrets only ever travel in those frames (TLS when the router has it).
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass

from shoal.protocol.ids import WorkerId
from shoal.protocol.messages import RpcPeer, TunnelDial
from shoal.router.deployments.deployment import StageLink, TunnelBytes
from shoal.router.dispatch.workers import Registry, WorkerConnection
from shoal.tunnel.handshake import StageWanted, TunnelId
from shoal.tunnel.hub import StageUnavailable, TunnelHub

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Route:
    deployment: str
    stage: WorkerId


class RouterTunnels:
    """``shards.Tunnels`` over a ``TunnelHub`` listening beside the router."""

    def __init__(
        self, registry: Registry, host: str, port: int, tls: ssl.SSLContext | None
    ) -> None:
        self.registry = registry
        self.hub = TunnelHub(self._stage_wanted, host=host, port=port, ssl_context=tls)
        self._routes: dict[TunnelId, _Route] = {}
        self._closed: dict[str, TunnelBytes] = {}
        """Per deployment: what its tunnels closed so far carried."""

    async def serve(self) -> None:
        """Listen until cancelled (in the router's task group)."""
        await self.hub.serve()

    def open(self, deployment: str, stage: WorkerConnection) -> RpcPeer:
        if not self.hub.started.is_set():
            raise RuntimeError("the tunnel listener is not up yet")
        tunnel = self.hub.open_tunnel()
        self._routes[tunnel.id] = _Route(deployment, stage.id)
        return RpcPeer(
            worker_id=stage.id,
            tunnel_id=tunnel.id,
            tunnel_token=tunnel.head_token,
            tunnel_port=self.hub.port,
        )

    def close(self, deployment: str) -> None:
        for tunnel_id, route in list(self._routes.items()):
            if route.deployment == deployment:
                del self._routes[tunnel_id]
                carried = self._carried(tunnel_id)
                self.hub.close_tunnel(tunnel_id)
                self._closed[deployment] = self._closed.get(deployment, TunnelBytes()) + carried

    def traffic(self, deployment: str) -> TunnelBytes:
        total = self._closed.get(deployment, TunnelBytes())
        for tunnel_id, route in self._routes.items():
            if route.deployment == deployment:
                total += self._carried(tunnel_id)
        return total

    def links(self, deployment: str) -> dict[str, StageLink]:
        out = {}
        for tunnel_id, route in self._routes.items():
            tunnel = self.hub.tunnel(tunnel_id)
            if route.deployment == deployment and tunnel is not None:
                out[str(route.stage)] = StageLink(
                    carried=self._carried(tunnel_id),
                    turnarounds_ns=tuple(tunnel.turnarounds),
                    connections=tunnel.live_connections,
                )
        return out

    def _carried(self, tunnel_id: TunnelId) -> TunnelBytes:
        tunnel = self.hub.tunnel(tunnel_id)
        if tunnel is None:
            return TunnelBytes()
        return TunnelBytes(tunnel.bytes_head_to_stage, tunnel.bytes_stage_to_head)

    async def _stage_wanted(self, wanted: StageWanted) -> None:
        route = self._routes.get(wanted.tunnel_id)
        worker = self.registry.get(route.stage) if route is not None else None
        if route is None or worker is None:
            raise StageUnavailable("the stage worker is not connected to this router")
        worker.send(
            TunnelDial(
                deployment=route.deployment,
                tunnel_id=wanted.tunnel_id,
                conn_no=wanted.conn_no,
                token=wanted.token,
                port=self.hub.port,
            )
        )
