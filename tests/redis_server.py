"""A private ``redis-server`` for tests that stop and restart Redis.

The shared Redis at 127.0.0.1:6379 must stay up for every other test, so a test that takes
Redis down runs its own: its own port and data dir, an append-only file fsynced on every
write (``appendfsync always``), so whatever a client was told is written survives a stop
(SIGTERM, ``SHUTDOWN NOSAVE`` or SIGKILL) and a start on the same port.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = Path("/usr/bin/redis-server")
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers_ping(port: int) -> bool:
    """Redis on ``port`` answers PING (not while it still loads its append-only file)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class OwnRedis:
    """A private redis-server with an append-only file, so data survives a restart."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [str(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        argv += ["--dir", str(self.dir)]
        with (self.dir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if answers_ping(self.port):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start; see {self.dir}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it: SIGTERM flushes the append-only file; SIGKILL is a crash (with
        ``appendfsync always`` nothing acknowledged is lost either way)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@contextlib.contextmanager
def own_redis_server(tmp_path: Path) -> Iterator[OwnRedis]:
    """A private, restartable redis-server (data under ``tmp_path``), stopped afterwards.

    For a test module's fixture: ``with own_redis_server(tmp_path) as server: yield server``.
    """
    if not REDIS_SERVER.exists() or shutil.which("redis-server") is None:
        pytest.fail(f"{REDIS_SERVER} is missing: install it with `apt-get install redis-server`")
    data_dir = tmp_path / "redis"
    data_dir.mkdir()
    server = OwnRedis(data_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
