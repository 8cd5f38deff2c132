#!/usr/bin/env python3
"""The image's healthcheck: exit 0 when the Shoal command this container runs is serving.

router and up: ``GET /health`` answers 200 (the router is up; a router with no ready worker
is still healthy: it queues). data: its port accepts a connection. worker: its llama-server
answers ``GET /health`` with 200 (loaded and ready); a worker attached to another server
(``SHOAL_BACKEND_URL``) is healthy while it runs. ``SHOAL_HEALTHCHECK_URL`` overrides all that.
"""

from __future__ import annotations

import os
import socket
import ssl
import sys
import urllib.request
from pathlib import Path

TIMEOUT_S = 4.0


def _get(url: str) -> bool:
    context = ssl._create_unverified_context()  # our own server, by loopback
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _router(default_port: int) -> bool:
    port = int(os.environ.get("SHOAL_PORT", default_port))
    scheme = "https" if os.environ.get("SHOAL_TLS_CERT") else "http"
    return _get(f"{scheme}://127.0.0.1:{port}/health")


def _data() -> bool:
    port = int(os.environ.get("SHOAL_PORT", 8100))
    try:
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _llama_server_ports() -> list[int]:
    """The ``--port`` of every llama-server running in this container."""
    ports = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"llama-server") and b"--port" in argv:
            at = argv.index(b"--port") + 1
            if at < len(argv) and argv[at].isdigit():
                ports.append(int(argv[at]))
    return ports


def _worker() -> bool:
    if os.environ.get("SHOAL_BACKEND_URL"):
        return True
    return any(_get(f"http://127.0.0.1:{port}/health") for port in _llama_server_ports())


def main() -> int:
    url = os.environ.get("SHOAL_HEALTHCHECK_URL")
    if url:
        return 0 if _get(url) else 1
    try:
        command = Path("/tmp/shoal-command").read_text().strip()
    except OSError:
        command = "up"
    checks = {
        "router": lambda: _router(8000),
        "up": lambda: _router(8000),
        "data": _data,
        "worker": _worker,
    }
    check = checks.get(command)
    return 0 if check is None or check() else 1


if __name__ == "__main__":
    sys.exit(main())
