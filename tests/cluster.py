"""Real Shoal processes for tests: routers and workers on free loopback ports.

Everything here starts real programs (``python -m shoal ...``, llama-server) and stops them
again; a test gets log files to read when it fails.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

import http_calls
from certs import Certs

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-test-inference"
GPU_KEY = "gpu-test-key"
STARTUP_TIMEOUT_S = 60.0
TEST_DRAIN_TIMEOUT_S = 2.0
"""A test's worker drains on SIGTERM for this long at most (its own --drain-timeout wins):
at teardown its router stops with it, and no job it still holds could be answered."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail the test with ``what``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
            last_error = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} ({last_error!r})")


@contextmanager
def plain_llama_server(binary: Path, model: Path, log_path: Path, *args: str) -> Iterator[str]:
    """A llama-server of ``model`` on a free port with ``args``, started here (no worker's):
    its URL once it answers ``/health``; stopped on leaving."""
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(
                lambda: http_calls.get(url + "/health").status_code == 200, 60, "llama-server"
            )
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(extra)
    return env


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    ctrl_c: bool = False
    """Start it as a terminal would, Ctrl-C (SIGINT) at its default action, even where this
    test run ignores SIGINT (started in the background by a script, as CI may be): a program
    inherits an ignored SIGINT and, as it should, never sees a Ctrl-C then."""

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            preexec_fn=_sigint_default if self.ctrl_c else None,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        self.signal(signal.SIGTERM)
        return self.reap(timeout)

    def reap(self, timeout: float) -> int | None:
        """Wait for a process already told to stop (one SIGTERM only: a second one would cut
        its clean-up short); SIGKILL past ``timeout``."""
        if self.popen is None:
            return None
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        return self.popen.returncode

    def wait(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Router:
    proc: Proc
    port: int
    api_key: str | None
    ca: Path | None = None
    """The CA that signed the router's TLS certificate, when it serves HTTPS (and WSS)."""

    @property
    def scheme(self) -> str:
        return "https" if self.ca else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @functools.cached_property
    def verify(self) -> ssl.SSLContext | bool:
        """For httpx's ``verify=``: trust the router's CA when it serves HTTPS (one context,
        made once: a context loads its certificates when made, and the tests poll)."""
        return ssl.create_default_context(cafile=self.ca) if self.ca else True

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def workers(self) -> list[dict[str, Any]]:
        r = http_calls.get(
            self.url + "/api/v1/workers", headers=self.headers, timeout=5, verify=self.verify
        )
        r.raise_for_status()
        data: list[dict[str, Any]] = r.json()["data"]
        return data

    def wait_workers(self, ready: int, timeout: float = STARTUP_TIMEOUT_S) -> list[dict[str, Any]]:
        def check() -> list[dict[str, Any]] | None:
            ws = [w for w in self.workers() if w["state"] == "ready"]
            return ws if len(ws) >= ready else None

        result: list[dict[str, Any]] = wait_until(check, timeout, f"{ready} ready worker(s)")
        return result


@dataclass
class Cluster:
    """A factory for routers and workers that stops everything it started."""

    base: Path
    llama_server: Path
    model_path: Path
    procs: list[Proc] = field(default_factory=list)
    counter: int = 0

    @property
    def database_url(self) -> str:
        """This cluster's key database (routers share it unless a test gives another)."""
        return f"sqlite:///{self.base}/shoal.db"

    @property
    def tag(self) -> str:
        """Marks this cluster's processes (and their llama-servers) in their environment."""
        return str(self.base)

    def _proc(
        self, kind: str, args: list[str], env: dict[str, str], wrap: list[str] | None = None
    ) -> Proc:
        self.counter += 1
        proc = Proc(
            kind,
            [*(wrap or []), sys.executable, "-m", "shoal", kind, *args],
            self.base / f"{self.counter:02d}-{kind}.log",
            {"SHOAL_DATABASE_URL": self.database_url, **env, CLUSTER_TAG: self.tag},
        )
        self.procs.append(proc)
        return proc.start()

    def router(
        self,
        *args: str,
        port: int | None = None,
        api_key: str | None = API_KEY,
        gpu_key: str | None = GPU_KEY,
        wait: bool = True,
        tls_ca: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> Router:
        """A router; with ``tls_ca`` (pass --tls-cert/--tls-key in ``args``) it serves HTTPS.
        ``env``: more variables for its environment (it gets no SHOAL_* one of this shell)."""
        port = port or free_port()
        env = clean_env(**(env or {}))
        if api_key:
            env["SHOAL_ROUTER_API_KEY"] = api_key
        if gpu_key:
            env["SHOAL_GPU_KEY"] = gpu_key
        proc = self._proc("router", ["--port", str(port), "--heartbeat-interval", "1", *args], env)
        router = Router(proc, port, api_key, tls_ca)
        if wait:
            wait_until(
                lambda: (
                    http_calls.get(
                        router.url + "/health", timeout=2, verify=router.verify
                    ).status_code
                    == 200
                ),
                STARTUP_TIMEOUT_S,
                "the router to answer /health",
            )
        return router

    def worker(
        self,
        router: Router,
        *args: str,
        name: str = "w",
        gpu_key: str | None = GPU_KEY,
        model: bool = True,
        env: dict[str, str] | None = None,
        wrap: list[str] | None = None,
        threads: int | None = 1,
    ) -> Proc:
        """A worker of the default model (with ``model``); ``threads`` None gives no
        ``--threads``, so the worker decides."""
        env = {**(clean_env(SHOAL_GPU_KEY=gpu_key) if gpu_key else clean_env()), **(env or {})}
        env.setdefault("SHOAL_DRAIN_TIMEOUT", str(TEST_DRAIN_TIMEOUT_S))
        argv = [
            "--router-url",
            router.url if router.ca else f"127.0.0.1:{router.port}",
            "--name",
            name,
            "--cache-dir",
            str(self.base / "cache"),
        ]
        if threads is not None:
            argv += ["--threads", str(threads)]
        if model:
            argv += [
                "--llama-server-path",
                str(self.llama_server),
                "--model",
                str(self.model_path),
                "--model-alias",
                MODEL,
            ]
        return self._proc("worker", [*argv, *args], env, wrap)

    def data(self, *args: str) -> Proc:
        """A `shoal data` model store, on this cluster's key database (as its routers are)."""
        return self._proc("data", list(args), clean_env())

    def key(self, scope: str) -> str:
        """A new key of ``scope`` (admin, worker, ...) in this cluster's key database."""
        return keys_cli(self.database_url, "create", "--scope", scope).splitlines()[-1].strip()

    def tls_store(self, certs: Certs, storage: Path, *args: str) -> tuple[Proc, str]:
        """`shoal data` over HTTPS on this cluster's key database, once it answers; its URL."""
        port = free_port()
        proc = self.data(
            *("--storage", str(storage), "--port", str(port)),
            *("--tls-cert", str(certs.cert), "--tls-key", str(certs.key), *args),
        )
        url = f"https://127.0.0.1:{port}"
        trusting = ssl.create_default_context(cafile=certs.ca)

        def up() -> bool:
            assert proc.alive(), proc.log()[-3000:]
            try:
                r = http_calls.get(url + STORE_REGISTRY, verify=trusting, timeout=2)
                return r.status_code > 0
            except OSError:
                return False

        wait_until(up, 30, "the store to answer over HTTPS")
        return proc, url

    def pull_worker(
        self,
        redis_url: str,
        redis_prefix: str,
        *args: str,
        name: str = "pw",
        model: bool = True,
    ) -> Proc:
        """A pull-mode worker: takes jobs straight from Redis (``--redis-url``), no router."""
        argv = ["--redis-url", redis_url, "--redis-prefix", redis_prefix, "--name", name]
        argv += ["--cache-dir", str(self.base / "cache"), "--threads", "1"]
        argv += ["--llama-server-path", str(self.llama_server)]
        if model:
            argv += ["--model", str(self.model_path), "--model-alias", MODEL]
        return self._proc(
            "worker", [*argv, *args], clean_env(SHOAL_DRAIN_TIMEOUT=str(TEST_DRAIN_TIMEOUT_S))
        )

    def stop_all(self, timeout: float = 15.0) -> None:
        """SIGTERM to every process at once, then wait for each (SIGKILL past ``timeout``):
        a test's teardown takes as long as its slowest process, not the sum of them all."""
        for proc in reversed(self.procs):
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in reversed(self.procs):
            proc.reap(max(0.0, deadline - time.monotonic()))

    def logs(self) -> str:
        return "\n".join(f"===== {p.log_path.name}\n{p.log()[-4000:]}" for p in self.procs)


KEYS_CLI_TIMEOUT_S = 60
STORE_REGISTRY = "/api/v1/models/registry"
UPLOAD_CLI_TIMEOUT_S = 120


def upload_cli(
    url: str, path: Path, key: str, ca: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """`shoal data upload` as a user runs it (the CA from its variable, SHOAL_TLS_CA)."""
    return subprocess.run(
        [sys.executable, "-m", "shoal", "data", "upload", str(path), "--store", url, "--key", key]
        + list(args),
        capture_output=True,
        text=True,
        timeout=UPLOAD_CLI_TIMEOUT_S,
        env=clean_env(SHOAL_TLS_CA=str(ca)),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def keys_cli(database_url: str, *args: str) -> str:
    """Run `shoal keys ARGS` as its own process, as a user would; its standard output."""
    done = subprocess.run(
        [sys.executable, "-m", "shoal", "keys", *args, "--database-url", database_url],
        capture_output=True,
        text=True,
        timeout=KEYS_CLI_TIMEOUT_S,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


CLUSTER_TAG = "SHOAL_TEST_CLUSTER"
"""Set in the environment of every process a Cluster starts; llama-server inherits it."""


def llama_server_pids(tag: str | None = None) -> set[int]:
    """Running llama-server processes (by executable, not by a flag that mentions it); with
    ``tag``, only those started under a Cluster with that tag."""
    found = set()
    for proc in psutil.process_iter(["name", "environ"]):
        if proc.info["name"] != "llama-server":
            continue
        environ = proc.info["environ"] or {}
        if tag is None or environ.get(CLUSTER_TAG) == tag:
            found.add(proc.pid)
    return found


def iter_sse(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]
