"""A worker and the machine it starts on: a model file cut short (issue 24)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import MODEL, Cluster

pytestmark = pytest.mark.e2e

TRUNCATED_EXIT_S = 30.0
"""A worker given a cut file exits before it starts anything (0cc5c22 started llama-server six
times, about 30 s of backoff, then stayed up, failed)."""


def test_a_worker_given_a_truncated_model_exits_saying_what_to_do(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    whole = model_path.stat().st_size
    half = tmp_path / "half.gguf"
    with model_path.open("rb") as f:
        half.write_bytes(f.read(whole // 2))
    router = cluster.router()
    worker = cluster.worker(
        router,
        *("--llama-server-path", str(cluster.llama_server)),
        *("--model", str(half), "--model-alias", MODEL),
        model=False,
    )
    code = worker.wait(TRUNCATED_EXIT_S)
    log = worker.log()
    assert code != 0, log
    expected = f"{half} is truncated: {whole // 2} of {whole} bytes; delete it and pull again."
    assert expected in log, log
    assert "Traceback" not in log, log
    assert "starting " not in log, log  # no llama-server was started
