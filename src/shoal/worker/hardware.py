"""A summary of this machine for the router. GPU detection comes with the hardware issue."""

from __future__ import annotations

import os
import platform
import socket

import psutil

from shoal.protocol.messages import Hardware


def detect() -> Hardware:
    mem = psutil.virtual_memory()
    return Hardware(
        hostname=socket.gethostname(),
        os=f"{platform.system()} {platform.release()} {platform.machine()}",
        cpu_count=os.cpu_count() or 1,
        ram_total_bytes=int(mem.total),
        ram_available_bytes=int(mem.available),
    )


def ram_available() -> int:
    return int(psutil.virtual_memory().available)
