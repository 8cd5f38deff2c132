"""A FAKE Hugging Face Hub: a real HTTP server on 127.0.0.1 that answers like huggingface.co.

It imitates the endpoints huggingface_hub 2.4 calls for Shoal, with the headers the client reads:

- ``HEAD``/``GET /{repo}/resolve/{revision}/{path}``: ``302`` to a download host with
  ``X-Repo-Commit``, ``X-Linked-Etag`` (the LFS sha256), ``X-Linked-Size`` and ``ETag``, as the
  Hub answers for LFS files. Errors carry ``X-Error-Code`` (``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``) and ``X-Error-Message`` like the Hub's.
- ``GET``/``HEAD /cdn/{sha256}`` on a second port (another origin, like the Hub's CDN / Xet
  bridge): the bytes, with ``Range`` and ``206``. No auth there: the real URL is signed.
- ``GET /api/models`` (search: ``search``, ``filter``, ``sort``, ``limit``, ``expand``),
  ``/api/models/{repo}[/revision/{rev}]`` and ``/api/models/{repo}/tree/{rev}[/{path}]``.

It never advertises Xet (no ``X-Xet-*`` headers, no ``xet-auth`` link), so clients take the plain
HTTP path. Controls: a token per gated repo, cutting the connection after N bytes on the first
download of a file, serving damaged bytes, a bandwidth limit, a log of every request, and a
count of the bytes sent of each file (``sent``).

In tests: ``with FakeHub.start(files={("org/repo", "x.gguf"): b"GGUF..."}) as hub: hub.url``.
As a process: ``python -m fakes.fake_hub --serve DIR --port N`` serves ``DIR/<org>/<name>/...``
and prints its URL on the first line of stdout (``--help`` lists the controls).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

from fakes.hub_data import (
    FakeFile,
    FileKey,
    RepoInfo,
    by_path,
    model_json,
    search_results,
    sibling,
    tree_entries,
)

__all__ = ["FakeFile", "FakeHub", "FileKey", "RecordedRequest", "RepoInfo", "load_dir", "main"]

logger = logging.getLogger(__name__)

_RESOLVE_RE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_API_REPO_RE = re.compile(
    r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)??)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)"
    r"(?:/(?P<sub>.+))?)?$"
)
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 64 * 1024
_HANDLER_TIMEOUT_S = 30.0
_POLL_S = 0.02
"""How often the servers check for shutdown (stop() waits for it)."""


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake saw it; header names are lower-case."""

    server: str
    """``hub`` or ``cdn``."""
    method: str
    path: str
    query: str
    headers: Mapping[str, str]

    @property
    def range(self) -> str | None:
        return self.headers.get("range")

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "range": self.range,
            "authorized": self.authorization is not None,
        }


@dataclass
class _State:
    files: dict[FileKey, FakeFile]
    repos: dict[str, RepoInfo]
    gated: dict[str, str]
    cut_after: dict[FileKey, int]
    corrupt: set[FileKey]
    no_ranges: set[FileKey]
    bytes_per_second: int | None
    log_file: Path | None
    requests: list[RecordedRequest] = field(default_factory=list)
    sent: dict[FileKey, int] = field(default_factory=dict)
    """Body bytes of each file sent by the download host."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeHub:
    """The fake hub and its download host, on two ports of 127.0.0.1.

    ``files`` maps (repo, path) to bytes or a file to serve. ``gated`` maps a repo to the token it
    requires. ``cut_after`` drops the connection after that many bytes of the first download
    of a file. ``corrupt`` files are served with one byte flipped (headers keep the true
    sha256). ``no_ranges`` files are always sent whole with 200, as a server that ignores
    ``Range`` may. ``repos`` sets search data; every repo with files is listed.
    """

    def __init__(
        self,
        files: Mapping[FileKey, bytes | Path],
        *,
        gated: Mapping[str, str] | None = None,
        cut_after: Mapping[FileKey, int] | None = None,
        corrupt: Iterable[FileKey] = (),
        no_ranges: Iterable[FileKey] = (),
        repos: Mapping[str, RepoInfo] | None = None,
        bytes_per_second: int | None = None,
        port: int = 0,
        cdn_port: int = 0,
        log_file: Path | None = None,
    ) -> None:
        fake_files = {key: FakeFile.of(key[0], key[1], content) for key, content in files.items()}
        known = {repo: RepoInfo() for repo, _ in fake_files} | dict(repos or {})
        self._state = _State(
            files=fake_files,
            repos=known,
            gated=dict(gated or {}),
            cut_after=dict(cut_after or {}),
            corrupt=set(corrupt),
            no_ranges=set(no_ranges),
            bytes_per_second=bytes_per_second,
            log_file=log_file,
        )
        self._hub = _Server(("127.0.0.1", port), self, "hub")
        self._cdn = _Server(("127.0.0.1", cdn_port), self, "cdn")
        self._threads: list[threading.Thread] = []

    @classmethod
    def start(cls, files: Mapping[FileKey, bytes | Path], **options: Any) -> FakeHub:
        """A running fake hub; use it as a context manager to stop it."""
        hub = cls(files, **options)
        hub._serve()
        return hub

    def __enter__(self) -> Self:
        if not self._threads:
            self._serve()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._state.lock:
            return list(self._state.requests)

    def clear_requests(self) -> None:
        with self._state.lock:
            self._state.requests.clear()

    def sent(self, repo: str, path: str) -> int:
        """Bytes of this file the download host has sent (every GET's body, ranges included)."""
        with self._state.lock:
            return self._state.sent.get((repo, path), 0)

    def file(self, repo: str, path: str) -> FakeFile:
        return self._state.files[(repo, path)]

    def downloads(self, repo: str, path: str) -> list[RecordedRequest]:
        """The GETs of this file's bytes on the download host."""
        wanted = _file_query(repo, path)
        return [
            r
            for r in self.requests
            if r.server == "cdn" and r.method == "GET" and r.query == wanted
        ]

    def resolves(self, repo: str, path: str) -> list[RecordedRequest]:
        """The HEAD and GET requests of ``/{repo}/resolve/.../{path}``."""
        return [r for r in self.requests if _resolve_key(r.path) == (repo, path)]

    def commit(self, repo: str) -> str:
        """The commit hash the fake reports for ``repo`` (any revision but ``main`` is unknown)."""
        return hashlib.sha1(f"commit {repo}".encode()).hexdigest()

    def stop(self) -> None:
        for server in (self._hub, self._cdn):
            if self._threads:
                server.shutdown()
            server.close_connections()
            server.server_close()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _serve(self) -> None:
        for server in (self._hub, self._cdn):
            thread = threading.Thread(
                target=server.serve_forever, args=(_POLL_S,), name=f"fake-hub-{server.role}"
            )
            thread.start()
            self._threads.append(thread)

    # --- request handling (called from the servers' handler threads) ---

    def handle(self, handler: _Handler, role: str) -> None:
        split = urlsplit(handler.path)
        headers = {k.lower(): v for k, v in handler.headers.items()}
        self._record(RecordedRequest(role, handler.command, split.path, split.query, headers))
        head = handler.command == "HEAD"
        if role == "cdn":
            self._download(handler, split.path, split.query, head)
        elif (match := _RESOLVE_RE.match(split.path)) is not None:
            self._resolve(handler, match, head)
        elif split.path == "/api/models":
            found = search_results(self._state.repos, parse_qs(split.query))
            _json(handler, 200, [self._model_json(repo, expand) for repo, expand in found], head)
        elif (match := _API_REPO_RE.match(split.path)) is not None:
            self._repo_api(handler, match, parse_qs(split.query), head)
        else:
            _error(handler, 404, None, "Not found", head)

    def _record(self, request: RecordedRequest) -> None:
        with self._state.lock:
            self._state.requests.append(request)
            if self._state.log_file is not None:
                with self._state.log_file.open("a", encoding="utf-8") as log:
                    log.write(json.dumps(request.to_json()) + "\n")

    def _check_repo(self, handler: _Handler, repo: str, rev: str | None, head: bool) -> bool:
        """Answer with the Hub's error and return False unless ``repo`` at ``rev`` may be read."""
        auth = handler.headers.get("Authorization")
        if repo not in self._state.repos:
            status = 404 if auth else 401  # the Hub hides whether a repo exists from anonymous
            _error(handler, status, "RepoNotFound", "Repository not found", head)
            return False
        token = self._state.gated.get(repo)
        if token is not None and auth != f"Bearer {token}":
            message = (
                f"Access to model {repo} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in."
                if auth is None
                else f"Access to model {repo} is restricted and you are not in the authorized "
                f"list. Visit {self.url}/{repo} to ask for access."
            )
            _error(handler, 401 if auth is None else 403, "GatedRepo", message, head)
            return False
        if rev is not None and rev not in ("main", self.commit(repo)):
            _error(handler, 404, "RevisionNotFound", "Invalid rev id: " + rev, head)
            return False
        return True

    def _resolve(self, handler: _Handler, match: re.Match[str], head: bool) -> None:
        repo, rev, path = match["repo"], unquote(match["rev"]), unquote(match["file"])
        if not self._check_repo(handler, repo, rev, head):
            return
        commit = self.commit(repo)
        found = self._state.files.get((repo, path))
        if found is None:
            extra = {"X-Repo-Commit": commit}
            _error(handler, 404, "EntryNotFound", "Entry not found", head, extra)
            return
        location = f"{self.cdn_url}/cdn/{found.sha256}?{_file_query(repo, path)}"
        body = f"Found. Redirecting to {location}".encode()
        headers = {
            "Location": location,
            "X-Repo-Commit": commit,
            "X-Linked-Etag": f'"{found.sha256}"',
            "X-Linked-Size": str(found.size),
            "ETag": f'"{found.sha256}"',
            "Content-Type": "text/plain; charset=utf-8",
        }
        _send(handler, 302, headers, body, head)

    def _download(self, handler: _Handler, path: str, query: str, head: bool) -> None:
        params = parse_qs(query)
        key = (params.get("repo", [""])[0], params.get("file", [""])[0])
        found = self._state.files.get(key)
        if found is None or path != f"/cdn/{found.sha256}":
            _send(handler, 404, {"Content-Type": "text/plain"}, b"NoSuchKey", head)
            return
        asked = None if key in self._state.no_ranges else handler.headers.get("Range")
        span = _byte_range(asked, found.size)
        if span is None:
            _send(handler, 416, {"Content-Range": f"bytes */{found.size}"}, b"", head)
            return
        start, end = span
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{found.sha256}"',
            "Content-Length": str(end - start),
        }
        status = 200
        if asked is not None:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{found.size}"
        _start_response(handler, status, headers)
        if not head:
            self._send_body(handler, key, found, start, end)

    def _send_body(
        self, handler: _Handler, key: FileKey, found: FakeFile, start: int, end: int
    ) -> None:
        with self._state.lock:
            cut = self._state.cut_after.pop(key, None)
        stop = end if cut is None else min(end, start + cut)
        position = start
        while position < stop:
            chunk = found.read(position, min(stop, position + _CHUNK))
            if key in self._state.corrupt and position + len(chunk) == found.size:
                chunk = chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
            handler.wfile.write(chunk)
            position += len(chunk)
            with self._state.lock:
                self._state.sent[key] = self._state.sent.get(key, 0) + len(chunk)
            if self._state.bytes_per_second:
                time.sleep(len(chunk) / self._state.bytes_per_second)  # bandwidth limit
        handler.wfile.flush()
        if stop < end:
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)  # the "network" drops mid-file

    def _model_json(self, repo: str, expand: list[str] | None) -> dict[str, Any]:
        gated = repo in self._state.gated
        return model_json(repo, self._state.repos[repo], self.commit(repo), gated, expand)

    def _repo_files(self, repo: str) -> list[FakeFile]:
        return sorted((f for (r, _), f in self._state.files.items() if r == repo), key=by_path)

    def _repo_api(
        self, handler: _Handler, match: re.Match[str], params: Mapping[str, list[str]], head: bool
    ) -> None:
        repo, rev = match["repo"], unquote(match["rev"] or "main")
        if not self._check_repo(handler, repo, rev, head):
            return
        if match["kind"] == "tree":
            recursive = params.get("recursive", ["false"])[0].lower() == "true"
            entries = tree_entries(self._repo_files(repo), unquote(match["sub"] or ""), recursive)
            _json(handler, 200, entries, head)
            return
        info = self._model_json(repo, None)
        blobs = params.get("blobs", ["false"])[0].lower() == "true"
        info["siblings"] = [sibling(f, blobs) for f in self._repo_files(repo)]
        _json(handler, 200, info, head)


def _file_query(repo: str, path: str) -> str:
    return f"repo={quote(repo, safe='')}&file={quote(path, safe='')}"


def _resolve_key(path: str) -> FileKey | None:
    match = _RESOLVE_RE.match(path)
    return None if match is None else (match["repo"], unquote(match["file"]))


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) for a ``Range`` header; None if it cannot be satisfied."""
    if header is None:
        return 0, size
    match = _RANGE_RE.match(header.strip())
    if match is None:
        return 0, size  # unsupported forms are ignored, as servers may
    start = int(match[1])
    end = int(match[2]) + 1 if match[2] else size
    if start >= size:
        return None
    return start, min(end, size)


def _start_response(handler: _Handler, status: int, headers: Mapping[str, str]) -> None:
    handler.send_response(status)
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.end_headers()


def _send(
    handler: _Handler, status: int, headers: Mapping[str, str], body: bytes, head: bool
) -> None:
    _start_response(handler, status, {**headers, "Content-Length": str(len(body))})
    if not head:
        handler.wfile.write(body)


def _json(handler: _Handler, status: int, payload: Any, head: bool) -> None:
    body = json.dumps(payload).encode()
    _send(handler, status, {"Content-Type": "application/json"}, body, head)


def _error(
    handler: _Handler,
    status: int,
    code: str | None,
    message: str,
    head: bool,
    extra: Mapping[str, str] | None = None,
) -> None:
    headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
    if code is not None:
        headers["X-Error-Code"] = code
    _send(handler, status, headers, json.dumps({"error": message}).encode(), head)


class _Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # server_close() joins the handler threads

    def __init__(self, address: tuple[str, int], hub: FakeHub, role: str) -> None:
        self.hub = hub
        self.role = role
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def track(self, connection: socket.socket, is_open: bool) -> None:
        with self._open_lock:
            (self._open.add if is_open else self._open.discard)(connection)

    def close_connections(self) -> None:
        """End kept-alive connections so their handler threads return."""
        with self._open_lock:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = _HANDLER_TIMEOUT_S
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def do_GET(self) -> None:
        self.server.hub.handle(self, self.server.role)

    def do_HEAD(self) -> None:
        self.server.hub.handle(self, self.server.role)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fake hub %s: " + format, self.server.role, *args)


def load_dir(root: Path) -> dict[FileKey, Path]:
    """The files of ``root/<org>/<name>/...`` as fake hub files of repo ``org/name``."""
    files: dict[FileKey, Path] = {}
    for repo_dir in sorted(p for p in root.glob("*/*") if p.is_dir()):
        repo = repo_dir.relative_to(root).as_posix()
        for path in sorted(p for p in repo_dir.rglob("*") if p.is_file()):
            files[(repo, path.relative_to(repo_dir).as_posix())] = path
    return files


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.rpartition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _cut(text: str) -> tuple[FileKey, int]:
    key, value = _key_value(text)
    repo, sep, path = key.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected ORG/NAME:FILE=BYTES, got {text!r}")
    return (repo, path), int(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a FAKE Hugging Face Hub on 127.0.0.1.")
    parser.add_argument("--serve", type=Path, required=True, help="folder of <org>/<name>/files")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cdn-port", type=int, default=0)
    parser.add_argument(
        "--gate",
        type=_key_value,
        action="append",
        default=[],
        metavar="ORG/NAME=TOKEN",
        help="require this token for the repo",
    )
    parser.add_argument(
        "--cut-after",
        type=_cut,
        action="append",
        default=[],
        metavar="ORG/NAME:FILE=BYTES",
        help="drop the first download after N bytes",
    )
    parser.add_argument("--bytes-per-second", type=int, default=None)
    parser.add_argument("--log", type=Path, default=None, help="append requests as JSON lines")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    hub = FakeHub(
        load_dir(args.serve),
        gated=dict(args.gate),
        cut_after=dict(args.cut_after),
        bytes_per_second=args.bytes_per_second,
        port=args.port,
        cdn_port=args.cdn_port,
        log_file=args.log,
    )
    with hub:
        print(hub.url, flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
