from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from cluster import API_KEY, Cluster, llama_server_pids
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.locate import resolve
from shoal.models.default import DEFAULT_MODEL
from shoal.models.errors import ModelError
from shoal.models.resolve import resolve_model
from shoal.settings import CommonSettings

SETUP_HINT = "run the set-up first: scripts/dev.sh test (it builds llama.cpp and fetches the model)"


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


def _cluster(base: Path, llama_server: Path, model_path: Path) -> Iterator[Cluster]:
    before = llama_server_pids()
    cluster = Cluster(base, llama_server, model_path)
    try:
        yield cluster
    finally:
        cluster.stop_all()
    leaked = llama_server_pids() - before
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
