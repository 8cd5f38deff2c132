from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest
import redis

from big_gguf import big_tensor_gguf
from cluster import API_KEY, Cluster, llama_server_pids
from shoal.keys import KeyStore, open_store
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.locate import resolve
from shoal.models.default import DEFAULT_MODEL
from shoal.models.errors import ModelError
from shoal.models.resolve import resolve_model
from shoal.settings import CommonSettings

LLAMA_SERVER_EXIT_S = 10.0
SETUP_HINT = "run the set-up first: scripts/dev.sh test (it builds llama.cpp and fetches the model)"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Undo the log set-up of CLI commands run in process (their handler writes to this test's
    captured stderr, which is closed once the test ends)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return CommonSettings().cache_dir


@pytest.fixture(scope="session")
def llama_server(cache_dir: Path) -> Path:
    try:
        return resolve(
            explicit=None, cache_dir=cache_dir, path_env=None, allow_build=False
        ).llama_server
    except LlamaCppError as exc:
        pytest.fail(f"{exc}; {SETUP_HINT}")


@pytest.fixture(scope="session")
def model_path(cache_dir: Path) -> Path:
    try:
        return resolve_model(DEFAULT_MODEL.id, cache_dir, download=False).path
    except ModelError as exc:
        pytest.fail(f"{exc}; {SETUP_HINT}")


@pytest.fixture(scope="session")
def big_gguf(cache_dir: Path, model_path: Path) -> Path:
    """A 3-layer GGUF whose FFN tensors are over llama.cpp's 10 MiB RPC hash threshold
    (``big_gguf.py``), made once into the cache folder with the default model's tokenizer."""
    return big_tensor_gguf(cache_dir / "test-models", model_path)


def _cluster(base: Path, llama_server: Path, model_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(base, llama_server, model_path)
    try:
        yield cluster
    finally:
        cluster.stop_all()
    # A worker killed outright leaves its llama-server a SIGTERM (PR_SET_PDEATHSIG), which it
    # may take a moment to act on: give it that moment, not more.
    deadline = time.monotonic() + LLAMA_SERVER_EXIT_S
    while (leaked := llama_server_pids(cluster.tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leaked, f"llama-server processes left behind: {leaked}"


@pytest.fixture
def cluster(
    tmp_path: Path, llama_server: Path, model_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """Routers and workers for one test, all stopped (and checked gone) afterwards."""
    yield from _cluster(tmp_path, llama_server, model_path)


@pytest.fixture(scope="session")
def session_cluster(
    tmp_path_factory: pytest.TempPathFactory, llama_server: Path, model_path: Path
) -> Iterator[Cluster]:
    yield from _cluster(tmp_path_factory.mktemp("cluster"), llama_server, model_path)


@pytest.fixture
def make_client() -> Iterator[Callable[..., openai.OpenAI]]:
    """Official OpenAI clients for a router URL, all closed after the test."""
    clients: list[openai.OpenAI] = []

    def make(base_url: str, api_key: str = API_KEY) -> openai.OpenAI:
        client = openai.OpenAI(
            base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=60
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A Redis key prefix of this test's own (``--redis-prefix``); its keys are deleted after."""
    prefix = f"shoal-test-{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        for key in client.scan_iter(match=prefix + "*", count=500):
            client.unlink(key)
    finally:
        client.close()


PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
"""The machine's real PostgreSQL (trust auth) and its ``test`` database."""


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A database URL with a schema of this test's own (``options=-csearch_path``, as a user
    would write it); the schema is dropped after."""
    schema = f"shoal_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{PG_ADMIN}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'data' / 'shoal.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The router's database on SQLite (a file per test) and on PostgreSQL (a schema)."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture
def stores() -> Iterator[Callable[..., KeyStore]]:
    """Open stores on a URL (each migrates it); all are closed after the test."""
    opened: list[KeyStore] = []

    def make(url: str, **options: Any) -> KeyStore:
        store = open_store(url, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture(scope="session")
def tiny_sd_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Stable Diffusion pipeline on disk (scripts/make_tiny_sd_pipeline.py),
    built once per session (~5 MB, a few seconds)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("tiny-sd") / "tiny-sd"
    script = Path(__file__).parent.parent / "scripts" / "make_tiny_sd_pipeline.py"
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True)
    return out
