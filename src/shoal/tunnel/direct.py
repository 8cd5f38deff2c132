"""Direct mode: the head's ``llama-server --rpc`` connects straight to a stage's RPC server.

No tunnel code runs in direct mode. It is for trusted networks only, and opt-in: the stage's
``ggml-rpc-server`` must then listen on a LAN address (``-H <ipv4>``) instead of 127.0.0.1,
and ``ggml-rpc-server`` has NO authentication, so anything that can reach that address can
load tensors into it and run graphs on it (llama.cpp's own SECURITY.md: never on an untrusted
network). Relayed mode (the tunnel) keeps every RPC server on 127.0.0.1.
"""

from __future__ import annotations

import ipaddress


class DirectAddressError(ValueError):
    """A direct-mode address ggml-rpc-server cannot bind or llama-server cannot use."""


def direct_rpc_address(host: str, port: int) -> str:
    """``host:port`` for ``llama-server --rpc``, checked for what ggml-rpc-server accepts.

    ggml-rpc-server's ``-H`` takes an IPv4 literal only (``inet_addr``): no host names, no
    IPv6. The wildcard 0.0.0.0 cannot be dialled, so it is refused too.
    """
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise DirectAddressError(
            f"{host!r} is not an IPv4 address; ggml-rpc-server binds IPv4 literals only"
        ) from None
    if address.is_unspecified or address.is_multicast:
        raise DirectAddressError(f"{host} cannot be dialled; give the stage's LAN address")
    if not 0 < port < 65536:
        raise DirectAddressError(f"port {port} is out of range")
    return f"{address}:{port}"


def rpc_server_args(host: str, port: int, threads: int | None = None) -> list[str]:
    """ggml-rpc-server arguments that bind ``host:port`` (validated as for ``--rpc``)."""
    direct_rpc_address(host, port)
    args = ["-H", host, "-p", str(port)]
    if threads is not None:
        args += ["-t", str(threads)]
    return args
