"""How the worker verifies the servers it calls over TLS (a ``wss://`` router, an HTTPS model
store), and ``Refusal``: why it cannot join a router (``link/router_link.py`` raises it; the
CLI exits 2 when retrying cannot help).
"""

from __future__ import annotations

import ssl
from pathlib import Path


class Refusal(Exception):
    """This worker cannot join the router; when ``fatal``, retrying cannot help (exit 2)."""

    def __init__(self, message: str, *, fatal: bool = True) -> None:
        super().__init__(message)
        self.fatal = fatal


class UntrustedRouter(Refusal):
    """The router's TLS certificate cannot be verified: a setting to fix, not a network blip."""


def client_tls_context(ca: Path | None) -> ssl.SSLContext:
    """A context that verifies servers: against the system's CAs, or only ``ca`` (PEM).

    For the router link (``RouterLink(ssl=...)``) and HTTPS model stores alike.
    """
    try:
        return ssl.create_default_context(cafile=ca)
    except OSError as exc:  # ssl.SSLError too: the file is not a PEM certificate
        reason = exc.strerror or getattr(exc, "reason", None) or str(exc)
        raise UntrustedRouter(
            f"cannot use {ca} as the CA certificate (--tls-ca): {reason}. Give the PEM file "
            "of the CA that signed the router's certificate."
        ) from None
