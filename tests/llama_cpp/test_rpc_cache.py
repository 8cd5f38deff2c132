"""llama.cpp's RPC tensor cache: Shoal names its entries exactly as ggml-rpc-server does.

The proof runs the pinned build: a cold load through ``ggml-rpc-server -c`` writes a cache
file per weight tensor over 10 MiB, named by the hash llama.cpp's client computed; Shoal's
``stage_tensors`` + ``tensor_hash`` over the GGUF must give the same names and bytes (with
and without mmap, the loader's two upload paths). Then a stage pre-seeded by Shoal alone,
behind a byte-counting relay, must receive none of those weights from the head.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import http_calls
from cluster import Proc, clean_env, free_port, wait_until
from shoal.llama_cpp.binaries import rpc_server_beside
from shoal.llama_cpp.rpc_cache import (
    HASH_THRESHOLD,
    SUBDIR,
    RpcCache,
    entry_name,
    hashed,
    tensor_hash,
)
from shoal.models.gguf_info import inspect
from shoal.models.stage_tensors import stage_tensors
from shoal.worker.shards.rpc_seed import SeedOrder, seed

LOAD_TIMEOUT_S = 120.0


# ------------------------------------------------------------------ the hash and the folder


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", 0xCBF29CE484222325),  # FNV-1a-64 offset basis
        (b"a", 0xAF63DC4C8601EC8C),  # published FNV-1a-64 test vectors
        (b"foobar", 0x85944171F73967E8),
    ],
)
def test_tensor_hash_is_fnv1a_64(data: bytes, expected: int) -> None:
    assert tensor_hash(data) == expected


def test_entry_names_are_16_lowercase_hex_digits() -> None:
    assert entry_name(0xAB) == "00000000000000ab"
    assert entry_name(0xAF63DC4C8601EC8C) == "af63dc4c8601ec8c"


def test_only_tensors_over_10_mib_are_hashed() -> None:
    assert not hashed(HASH_THRESHOLD) and hashed(HASH_THRESHOLD + 1)


def test_a_damaged_entry_is_removed_not_used(tmp_path: Path) -> None:
    cache = RpcCache(tmp_path, max_bytes=1 << 30)
    digest = cache.put(b"x" * 1000)
    assert cache.has(digest, 1000)
    cache.path(digest).write_bytes(b"y" * 1000)  # same size, other bytes
    assert not cache.has(digest, 1000)
    assert not cache.path(digest).exists()
    assert not cache.has(digest, 1000)


def test_eviction_drops_the_least_recently_used_but_keeps_a_deploys_own(tmp_path: Path) -> None:
    cache = RpcCache(tmp_path, max_bytes=2500)
    a, b, c = (cache.put(bytes([n]) * 1000) for n in (1, 2, 3))
    for age, digest in enumerate((a, b, c)):  # a oldest
        os.utime(cache.path(digest), ns=(age * 10**9, age * 10**9))
    cache.has(a, 1000)  # used now: the newest
    evicted = cache.evict()
    assert (evicted.files, evicted.bytes) == (1, 1000)
    assert {p.name for p in cache.entries()} == {entry_name(a), entry_name(c)}
    cache.max_bytes = 0
    cache.evict(keep=[c])
    assert {p.name for p in cache.entries()} == {entry_name(c)}


# ------------------------------------------------------------------ which tensors


def test_a_stage_gets_its_layers_and_the_last_one_the_tied_output(big_gguf: Path) -> None:
    info = inspect(big_gguf)
    middle = stage_tensors(info, 1, 1, output=False)
    assert [t.name for t in middle] == [
        "blk.1.ffn_gate.weight",
        "blk.1.ffn_up.weight",
        "blk.1.ffn_down.weight",
    ]
    last = stage_tensors(info, 2, 2, output=True)
    assert info.tied_embeddings
    assert {t.name for t in last} == {
        "token_embd.weight",  # llama.cpp duplicates it as the output weight
        "blk.2.ffn_gate.weight",
        "blk.2.ffn_up.weight",
        "blk.2.ffn_down.weight",
    }
    assert all(t.nbytes > HASH_THRESHOLD for t in (*middle, *last))


# ------------------------------------------------------------------ against ggml-rpc-server


@dataclass
class CountingRelay:
    """A TCP relay to ``target`` counting the bytes sent towards it (threads, one per way)."""

    target: int
    port: int = field(default_factory=free_port)
    to_target: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sockets: list[socket.socket] = field(default_factory=list)

    def start(self) -> CountingRelay:
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._sockets.append(self._server)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while chunk := src.recv(1 << 20):
                dst.sendall(chunk)
                if counted:
                    with self._lock:
                        self.to_target += len(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for s in self._sockets:
            s.close()


@dataclass
class Split:
    """One ggml-rpc-server (with ``-c``) holding every layer, and a head loading onto it."""

    llama_server: Path
    gguf: Path
    tmp: Path

    def load(self, llama_cache: Path, *head_args: str) -> int:
        """Load the model onto a fresh stage; the bytes the head sent it."""
        rpc_server = rpc_server_beside(self.llama_server)
        assert rpc_server is not None, "the pinned build has no ggml-rpc-server"
        rpc_port, http_port = free_port(), free_port()
        stage = Proc(
            "stage",
            [str(rpc_server), "-c", "-t", "1", "-H", "127.0.0.1", "-p", str(rpc_port)],
            self.tmp / "stage.log",
            clean_env(LLAMA_CACHE=str(llama_cache)),
        ).start()
        relay: CountingRelay | None = None
        head: Proc | None = None
        try:
            wait_until(lambda: _accepts(rpc_port), 30, "ggml-rpc-server to listen")
            relay = CountingRelay(rpc_port).start()
            argv = [str(self.llama_server), "-m", str(self.gguf), "--host", "127.0.0.1"]
            argv += ["--port", str(http_port), "--rpc", f"127.0.0.1:{relay.port}"]
            argv += ["-ngl", "99", "--device", "RPC0", "--fit", "off", "-c", "256", "-np", "1"]
            argv += ["--cache-ram", "0", "-t", "1", *head_args]
            head = Proc("head", argv, self.tmp / "head.log", clean_env()).start()
            url = f"http://127.0.0.1:{http_port}/health"
            wait_until(lambda: _healthy(url, head), LOAD_TIMEOUT_S, "the head to load the model")
            return relay.to_target
        finally:
            if head is not None:
                head.stop()
            if relay is not None:
                relay.close()
            stage.stop()


def _accepts(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def _healthy(url: str, head: Proc) -> bool:
    assert head.alive(), f"llama-server exited:\n{head.log()[-3000:]}"
    return http_calls.get(url, timeout=2).status_code == 200


@pytest.fixture
def split(llama_server: Path, big_gguf: Path, tmp_path: Path) -> Iterator[Split]:
    yield Split(llama_server, big_gguf, tmp_path)


def _files(llama_cache: Path) -> dict[str, bytes]:
    folder = llama_cache / SUBDIR
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else {}


@pytest.mark.parametrize("load_mode", ["mmap", "none"])
def test_shoal_names_the_files_ggml_rpc_server_writes(
    split: Split, tmp_path: Path, load_mode: str
) -> None:
    cold = tmp_path / "cold"
    split.load(cold, "--load-mode", load_mode)
    written = _files(cold)

    info = inspect(split.gguf)
    ours = stage_tensors(info, 0, info.n_layers - 1, output=True)
    expected: dict[str, bytes] = {}
    with split.gguf.open("rb") as f:
        for t in ours:
            f.seek(t.offset)
            data = f.read(t.nbytes)
            expected[entry_name(tensor_hash(data))] = data
    assert len(expected) == 3 * info.n_layers + 1  # every FFN tensor and the tied output
    assert written.keys() == expected.keys()
    assert written == expected


def test_a_preseeded_stage_receives_no_weights(split: Split, tmp_path: Path) -> None:
    cold = split.load(tmp_path / "cold")

    seeded = tmp_path / "seeded"
    info = inspect(split.gguf)
    order = SeedOrder("test", split.gguf, 0, info.n_layers - 1, output=True)
    report = seed(RpcCache(seeded, max_bytes=1 << 40), order)
    before = _files(seeded)
    sent = split.load(seeded)

    share = report.bytes
    assert report.tensors == 3 * info.n_layers + 1 and report.cached == 0
    assert cold > share  # without the cache every weight crosses
    assert sent < 0.05 * share, (sent, share)  # only the small tensors and the protocol
    assert _files(seeded) == before  # the stage wrote nothing new: it had it all

    again = seed(RpcCache(seeded, max_bytes=1 << 40), order)
    assert again.cached == again.tensors and again.fetched_bytes == 0


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=8),
    budget=st.integers(0, 2000),
    keep=st.sets(st.integers(0, 7)),
)
def test_eviction_keeps_the_newest_that_fit_and_what_it_must(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], budget: int, keep: set[int]
) -> None:
    cache = RpcCache(tmp_path_factory.mktemp("lru"), max_bytes=budget)
    digests = []
    for n, size in enumerate(sizes):  # entry n is older than n + 1
        digest = cache.put(n.to_bytes(2, "little") * size)
        os.utime(cache.path(digest), ns=(n * 10**9, n * 10**9))
        digests.append(digest)
    kept = [digests[i] for i in keep if i < len(digests)]
    cache.evict(keep=kept)
    left = {p.name for p in cache.entries()}
    assert {entry_name(d) for d in kept} <= left
    total = cache.size()
    assert total <= budget or left == {entry_name(d) for d in kept}
    # Only the oldest went: an entry left is never older than one evicted (kept ones aside).
    gone = [n for n, d in enumerate(digests) if entry_name(d) not in left]
    stayed = [n for n, d in enumerate(digests) if entry_name(d) in left and d not in kept]
    assert not gone or not stayed or max(gone) < min(stayed)
