"""A split catalog model whose stages have no copy of it: they pre-seed their layers from
Hugging Face with HTTP Range, so the deploy sends almost no weights through the router.

Real router and three real workers (head + two stages, relayed mode), each with a cache of
its own; the Hub is a FAKE on loopback speaking Hugging Face's protocol (``fakes.fake_hub``),
serving the generated big-tensor GGUF (``big_gguf.py``) as one quantization of a catalog
model. The router has that file in its cache and pins it; the head downloads exactly it, the
stages fetch only their layers' hashed tensors and the header, and what crosses the tunnel
during the deploy is under 5 % of the stages' weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from split_models import deployment

import http_calls
from cluster import Cluster, Router, wait_until
from data.stores import link_or_copy
from fakes.fake_hub import FakeHub
from shoal.models.catalog_file import load_catalog
from shoal.models.gguf_header import HEADER_CHUNK
from shoal.models.gguf_info import inspect
from shoal.models.hub_cache import local_path
from shoal.models.stage_tensors import stage_tensors

pytestmark = pytest.mark.e2e

MODEL = "llama-3.3-70b-instruct"
"""No quantization of it fits here by the catalog's sizes, so the router plans with the one
in its cache (the generated GGUF, whose catalog entry lists no sha256 to contradict it)."""
QUANTIZATION = "Q2_K"
NAME = "hub-split"


def _deploy(router: Router) -> dict[str, object]:
    body = {
        "model": MODEL,
        "name": NAME,
        "workers": ["h", "s1", "s2"],
        "ctx": 512,
        "strategy": "balanced",
        "mode": "relayed",
    }
    r = http_calls.post(
        router.url + "/api/v1/pipeline/deploy", json=body, headers=router.headers, timeout=30
    )
    assert r.status_code == 202, r.text
    served: dict[str, object] = wait_until(
        lambda: (d := deployment(router, NAME))["state"] == "serving" and d,
        180,
        "the split model to serve",
    )
    return served


def test_stages_seed_from_the_hub_by_range_and_the_tunnel_carries_no_weights(
    cluster: Cluster, big_gguf: Path, tmp_path: Path
) -> None:
    entry = load_catalog().get(MODEL)
    assert entry is not None
    quant = entry.hub.quant(QUANTIZATION)
    assert quant is not None and not quant.sha256
    repo, filename = entry.hub.repo, quant.files[0]
    router_cache = tmp_path / "router-cache"
    planned_with = local_path(router_cache, repo, filename)
    planned_with.parent.mkdir(parents=True)
    link_or_copy(big_gguf, planned_with)
    info = inspect(big_gguf)
    size = big_gguf.stat().st_size
    hashed = stage_tensors(info, 1, 1, False) + stage_tensors(info, 2, 2, True)
    share = sum(t.nbytes for t in hashed)

    with FakeHub.start({(repo, filename): big_gguf}) as hub:
        router = cluster.router("--cache-dir", str(router_cache))
        for name in ("h", "s1", "s2"):
            cluster.worker(
                router,
                "--cache-dir",
                str(tmp_path / f"cache-{name}"),
                "--slots",
                "1",
                "--ctx-size",
                "512",
                name=name,
                env={"HF_ENDPOINT": hub.url},
            )
        router.wait_workers(3)
        served = _deploy(router)
        sent_by_hub = hub.sent(repo, filename)

    # Every shard used the file the router planned with.
    pinned = served["file"]
    assert isinstance(pinned, dict)
    assert (pinned["kind"], pinned["repo"], pinned["filename"]) == ("hub", repo, filename)
    assert pinned["size"] == size
    head_copy = local_path(tmp_path / "cache-h", repo, filename)
    assert head_copy.read_bytes() == big_gguf.read_bytes()
    for name in ("s1", "s2"):
        assert not local_path(tmp_path / f"cache-{name}", repo, filename).exists()

    shards = served["shards"]
    assert isinstance(shards, list)
    assert [s["layers"] for s in shards] == [[0, 0], [1, 1], [2, 2]]
    seeds = [s["seed"] for s in shards[1:]]
    assert [(s["source"], s["tensors"], s["error"]) for s in seeds] == [
        ("hub", 3, None),
        ("hub", 4, None),
    ]
    assert sum(s["bytes"] for s in seeds) == share

    # The hub sent the head the whole file, and the stages their share and the header each.
    stages_fetched = sent_by_hub - size
    assert share <= stages_fetched <= share + 2 * (info.data_offset + HEADER_CHUNK)

    last = served["last_deploy"]
    assert isinstance(last, dict)
    tunnel = last["tunnel_bytes"]["to_stages"]
    assert tunnel <= 0.05 * share, (tunnel, share)
